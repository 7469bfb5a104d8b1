"""Snapshot tensors staged to the device (cag.runtime.device_copy): every byte lands where it belongs,
across staging-buffer and tensor boundaries, on the CPU (plain staging) and on CUDA (pinned)."""

from __future__ import annotations

import pytest
import torch

from cag.runtime.device_copy import to_device
from cag.runtime.slots import PrefixKV

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]),
]


@pytest.mark.parametrize("device", DEVICES)
def test_staged_copies_are_the_tensors_bit_for_bit(device):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1, 3, 37, 64, generator=g).to(torch.bfloat16), torch.randn(0, 4),  # empty
               torch.randn(5, 7, generator=g).t(),  # not contiguous
               torch.randint(-128, 127, (1, 2, 9, 16), generator=g, dtype=torch.int8),
               torch.randn(2, 3, 11, generator=g).half()]
    out = to_device(tensors, device, chunk=100)  # pieces of 100 bytes: most cut inside a tensor
    for t, o in zip(tensors, out):
        assert o.device.type == device and o.dtype == t.dtype and o.shape == t.shape
        assert torch.equal(o.cpu().view(-1).view(torch.uint8) if o.numel() else o.cpu(),
                           t.contiguous().view(-1).view(torch.uint8) if t.numel() else t)


@pytest.mark.parametrize("device", DEVICES)
def test_a_prefix_on_the_device_equals_its_plain_copy(device):
    g = torch.Generator().manual_seed(1)
    kv = [
        (torch.randn(1, 2, 50, 64, generator=g).half(), torch.randn(1, 2, 50, 64, generator=g).half()) for _ in range(3)
    ]
    prefix = PrefixKV.of(kv, torch.bfloat16, device)
    for (k, v), (pk, pv) in zip(kv, prefix.kv):
        assert pk.device.type == device and pk.dtype == torch.bfloat16
        assert torch.equal(pk.cpu(), k.to(device, torch.bfloat16).cpu()) and torch.equal(
            pv.cpu(), v.to(device, torch.bfloat16).cpu()
        )
