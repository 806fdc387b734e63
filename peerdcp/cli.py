"""The ``peerdcp`` command: ``probe``, ``generate`` (the main job), ``run`` (one layer, timed) and ``bench``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _cmd_probe(args: argparse.Namespace) -> int:
    from .memory.probe import probe

    caps = probe()
    if args.json:
        print(caps.to_json())
    else:
        try:
            from rich.console import Console

            Console().print(caps.table(), markup=False, highlight=False)
        except ImportError:  # pragma: no cover
            print(caps.table())
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from .harness.run import main_run

    return main_run(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    from .harness.generate import main_generate

    return main_generate(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib.util
    import runpy

    name = f"bench.{args.mechanism}"
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        found = False
    if not found:  # the benchmarks live in the checkout (bench/), not in the installed package
        print(f"peerdcp bench: {name} not found; run it from the root of a peerdcp checkout", file=sys.stderr)
        return 2
    sys.argv = [name, *args.rest]
    runpy.run_module(name, run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="peerdcp", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("probe", help="report which peer-memory kinds are eligible here, and why")
    pp.add_argument("--json", action="store_true", help="machine-readable output")
    pp.set_defaults(func=_cmd_probe)

    pg = sub.add_parser(
        "generate", help="a transformers DSA/MLA model decoding with DCP beside the unsharded model, checked"
    )
    from .harness.generate import add_generate_arguments

    add_generate_arguments(pg)
    pg.set_defaults(func=_cmd_generate)

    pr = sub.add_parser("run", help="one DCP decode step through all three mechanisms, checked")
    from .harness.run import add_run_arguments

    add_run_arguments(pr)
    pr.set_defaults(func=_cmd_run)

    pb = sub.add_parser("bench", help="run an isolated benchmark (python -m bench.<mechanism>)")
    pb.add_argument("mechanism", choices=["output", "query", "topk"])
    pb.add_argument("rest", nargs=argparse.REMAINDER)
    pb.set_defaults(func=_cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # ``python -m peerdcp.cli`` runs like ``python -m peerdcp``
    raise SystemExit(main())
