"""ncu target of session 26 call 6: one-CTA selection of T rows x L scores, three calls (ncu profiles the third):
ncu --kernel-name regex:topk_select --launch-skip 2 --launch-count 1 ... python3 ncu_sel.py T L"""

import sys
from unittest import mock

import torch

from peerdcp.topk import ops
from peerdcp.topk.selector import _local_keys

T, L = int(sys.argv[1]), int(sys.argv[2])
x = torch.randn(T, L, device="cuda")
lens = torch.full((T,), L, dtype=torch.int64, device="cuda")
with mock.patch.dict(ops.TUNING, {"select_ctas": 1}):
    for _ in range(3):
        _local_keys(x, lens, 2048, 0, 1, 1, 0, 0)
    torch.cuda.synchronize()
