"""``cos_sin_cache`` builders: plain RoPE and YaRN (DeepSeek-V3.2, Kimi-K2), fp32, rows ``[cos | sin]``.

Row ``p`` of a table is ``[cos(p*f_0) .. cos(p*f_{d/2-1}) | sin(p*f_0) .. sin(p*f_{d/2-1})]`` for the
rotary dim ``d``. Plain frequencies: ``f_i = theta^(-2i/d)``. YaRN (as SGLang's
``DeepseekScalingRotaryEmbedding`` computes it, in fp32)::

    corr(n)  = d * ln(original / (2*pi*n)) / (2 * ln(theta))
    low      = max(floor(corr(beta_fast)), 0);  high = min(ceil(corr(beta_slow)), d - 1)
    ramp_i   = clamp((i - low) / (high - low), 0, 1)          (high += 0.001 when low == high)
    f_i'     = f_i / factor * ramp_i + f_i * (1 - ramp_i)
    table    = [cos(p*f') | sin(p*f')] * cos_sin_mscale,  p = 0 .. original*factor - 1

with ``cos_sin_mscale = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)``, which is 1.0
for DeepSeek-V3.2 and Kimi-K2 (``mscale == mscale_all_dim == 1``): their cos/sin are **unscaled**, the
YaRN magnitude correction goes into the softmax scale (:func:`yarn_softmax_scale`).
DeepSeek-V3.2: low = 10, high = 23; Kimi-K2: low = 19, high = 20 (see :func:`yarn_correction_range`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "YarnParams",
    "PRESETS",
    "plain_cos_sin_cache",
    "yarn_cos_sin_cache",
    "yarn_inv_freq",
    "yarn_correction_range",
    "yarn_mscale",
    "yarn_softmax_scale",
    "cos_sin_cache",
]


@dataclass(frozen=True)
class YarnParams:
    """RoPE parameters of a model; ``factor is None`` means plain RoPE (no YaRN)."""

    theta: float
    rope_dim: int = 64
    factor: float | None = None
    original_max_pos: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    max_pos: int | None = None  # plain RoPE: table length (YaRN: original_max_pos * factor)

    @property
    def table_len(self) -> int:
        if self.factor is None:
            if self.max_pos is None:
                raise ValueError("plain RoPE parameters need max_pos")
            return self.max_pos
        return int(self.original_max_pos * self.factor)


PRESETS: dict[str, YarnParams] = {
    # inference/config_671B_v3.2.json: rope_theta 1e4, YaRN factor 40 over 4096, beta_fast 32, beta_slow 1,
    # mscale = mscale_all_dim = 1; 163840 positions.
    "deepseek-v3.2": YarnParams(theta=10000.0, factor=40.0, original_max_pos=4096, beta_fast=32.0, beta_slow=1.0),
    # Kimi-K2-Instruct-0905 rope_scaling: theta 5e4, factor 64 over 4096, beta_fast 1, beta_slow 1; 262144 positions.
    "kimi-k2": YarnParams(theta=50000.0, factor=64.0, original_max_pos=4096, beta_fast=1.0, beta_slow=1.0),
    # GLM-5 (glm_moe_dsa): rope_type default, theta 1e6, 202752 positions.
    "glm-5": YarnParams(theta=1_000_000.0, max_pos=202752),
}


def _check_dim(rope_dim: int) -> None:
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim must be a positive even int, got {rope_dim!r}")


def _table(inv_freq: torch.Tensor, max_pos: int, scale: float, device: torch.device | str | None) -> torch.Tensor:
    t = torch.arange(max_pos, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq.to(device=device, dtype=torch.float32))
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.cat((cos, sin), dim=-1).contiguous()


def plain_cos_sin_cache(
    max_pos: int, rope_dim: int = 64, *, theta: float = 10000.0, device: torch.device | str | None = None
) -> torch.Tensor:
    """Plain RoPE table ``[max_pos, rope_dim]`` fp32, ``f_i = theta^(-2i/d)``."""
    _check_dim(rope_dim)
    if max_pos <= 0:
        raise ValueError(f"max_pos must be positive, got {max_pos}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    return _table(inv_freq, max_pos, 1.0, device)


def yarn_correction_range(
    beta_fast: float, beta_slow: float, rope_dim: int, theta: float, original_max_pos: int
) -> tuple[int, int]:
    """``(low, high)`` dims of the YaRN ramp (SGLang ``_yarn_find_correction_range``)."""

    def corr(n_rot: float) -> float:
        return rope_dim * math.log(original_max_pos / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    low = math.floor(corr(beta_fast))
    high = math.ceil(corr(beta_slow))
    return max(low, 0), min(high, rope_dim - 1)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_softmax_scale(qk_head_dim: int, factor: float, mscale_all_dim: float = 1.0) -> float:
    """MLA softmax scale ``qk_head_dim^-0.5 * mscale^2`` (DeepSeek-V3.2: 192 -> 0.135234)."""
    m = yarn_mscale(factor, mscale_all_dim)
    return qk_head_dim**-0.5 * m * m


def yarn_inv_freq(
    rope_dim: int, *, theta: float, factor: float, original_max_pos: int, beta_fast: float, beta_slow: float
) -> torch.Tensor:
    """YaRN-blended inverse frequencies ``[rope_dim / 2]`` fp32."""
    _check_dim(rope_dim)
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    low, high = yarn_correction_range(beta_fast, beta_slow, rope_dim, theta, original_max_pos)
    hi = high + 0.001 if low == high else high
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (hi - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: unchanged frequency (fast dims), 0: fully interpolated (slow dims)
    return interpolation * (1 - keep) + extrapolation * keep


def yarn_cos_sin_cache(
    rope_dim: int = 64,
    *,
    theta: float,
    factor: float,
    original_max_pos: int = 4096,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    mscale: float = 1.0,
    mscale_all_dim: float = 1.0,
    max_pos: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """YaRN table ``[max_pos, rope_dim]`` fp32 (default ``max_pos = original_max_pos * factor``)."""
    inv_freq = yarn_inv_freq(
        rope_dim,
        theta=theta,
        factor=factor,
        original_max_pos=original_max_pos,
        beta_fast=beta_fast,
        beta_slow=beta_slow,
    )
    n = int(original_max_pos * factor) if max_pos is None else max_pos
    if n <= 0:
        raise ValueError(f"max_pos must be positive, got {n}")
    scale = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return _table(inv_freq, n, scale, device)


def cos_sin_cache(
    preset: str | YarnParams, *, max_pos: int | None = None, device: torch.device | str | None = None
) -> torch.Tensor:
    """The table of a named model (``"deepseek-v3.2"``, ``"kimi-k2"``, ``"glm-5"``) or of ``YarnParams``."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown RoPE preset {preset!r}; known: {sorted(PRESETS)}")
        p = PRESETS[preset]
    elif isinstance(preset, YarnParams):
        p = preset
    else:
        raise TypeError(f"preset must be a name or YarnParams, got {type(preset).__name__}")
    if p.factor is None:
        return plain_cos_sin_cache(
            p.table_len if max_pos is None else max_pos, p.rope_dim, theta=p.theta, device=device
        )
    return yarn_cos_sin_cache(
        p.rope_dim,
        theta=p.theta,
        factor=p.factor,
        original_max_pos=p.original_max_pos,
        beta_fast=p.beta_fast,
        beta_slow=p.beta_slow,
        mscale=p.mscale,
        mscale_all_dim=p.mscale_all_dim,
        max_pos=max_pos,
        device=device,
    )
