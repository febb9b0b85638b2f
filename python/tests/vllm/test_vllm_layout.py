"""KV cache layouts: runs per block found from strides, for CPU and GPU layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ucm.integration.vllm.layout import LayoutError, build_layout, runs_of
from ucm.integration.vllm.transfer import HostStaging

NB, H, N, D = 8, 2, 32, 32


def _layer_index(name: str) -> int:
    return int(name.split(".")[2])


def layers_of(buf: torch.Tensor) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(buf.shape[0])}


def test_cpu_lbhnc_is_one_run_per_block() -> None:
    # vLLM 0.32 CPU: one [L, B, H, N, 2D] buffer; each layer a [B, H, N, 2D] view.
    buf = torch.randn(3, NB, H, N, 2 * D)
    lay = build_layout(layers_of(buf), NB, _layer_index, 3)
    assert (lay.runs, lay.run_bytes) == (1, H * N * 2 * D * 4)
    assert lay.block_bytes == 3 * H * N * 2 * D * 4
    a = lay.layers[2].addrs(np.array([5]))
    assert int(a[0, 0]) == buf[2, 5].data_ptr()


def test_gpu_layouts() -> None:
    elem = 2
    # LBNHC (FlashAttention default): physical [B, N, H, 2D] viewed as [B, H, N, 2D].
    p = torch.zeros(NB, N, H, 2 * D, dtype=torch.float16).permute(0, 2, 1, 3)
    offs, rb = runs_of(p.shape, p.stride(), 0, elem)
    assert offs == [0] and rb == N * H * 2 * D * elem
    # LHBNC: heads outside blocks: one run per head.
    p = torch.zeros(H, NB, N, 2 * D, dtype=torch.float16).permute(1, 0, 2, 3)
    offs, rb = runs_of(p.shape, p.stride(), 0, elem)
    assert rb == N * 2 * D * elem and offs == [h * NB * N * 2 * D * elem for h in range(H)]
    # Older FlashAttention [2, B, N, H, D]: K and V planes.
    p = torch.zeros(2, NB, N, H, D, dtype=torch.float16)
    lay = build_layout({"model.layers.0.attn": p}, NB, _layer_index, 1)
    assert lay.runs == 2 and lay.run_bytes == N * H * D * elem
    a = lay.layers[0].addrs(np.array([3]))
    assert int(a[0, 0]) == p[0, 3].data_ptr() and int(a[0, 1]) == p[1, 3].data_ptr()
    # MLA [B, N, D_latent].
    p = torch.zeros(NB, N, 576, dtype=torch.float16)
    offs, rb = runs_of(p.shape, p.stride(), 0, elem)
    assert offs == [0] and rb == N * 576 * elem


def test_bad_layouts_are_refused() -> None:
    buf = torch.randn(2, NB, H, N, 2 * D)
    layers = layers_of(buf)
    layers["model.layers.1.self_attn.attn"] = torch.randn(NB, H, N, D)
    with pytest.raises(LayoutError, match="different KV shapes"):
        build_layout(layers, NB, _layer_index, 2)
    with pytest.raises(LayoutError, match="num_blocks"):
        build_layout(layers_of(buf), NB + 1, _layer_index, 2)


@pytest.mark.parametrize("permute", [False, True])
def test_host_staging_round_trip(permute: bool) -> None:
    if permute:  # LHBNC: several runs per block
        buf = torch.randn(2, H, NB, N, 2 * D).permute(0, 2, 1, 3, 4)
    else:
        buf = torch.randn(2, NB, H, N, 2 * D)
    lay = build_layout(layers_of(buf), NB, _layer_index, 2, with_views=True)
    st = HostStaging(lay, event_sync=True)
    host, addrs, event = st.gather([0, 1], [6, 2])
    assert event is None and addrs.shape == (2 * 2, lay.runs)
    out = torch.zeros_like(buf)
    lay2 = build_layout(layers_of(out), NB, _layer_index, 2, with_views=True)
    HostStaging(lay2, event_sync=True).scatter(host, [0, 1], [1, 7])
    assert torch.equal(out[:, 1], buf[:, 6]) and torch.equal(out[:, 7], buf[:, 2])
    assert out[:, [0, 2, 3, 4, 5, 6]].abs().sum() == 0
    # The addresses point at the host buffer's runs, in [layer, block, run] order.
    assert int(addrs[0, 0]) == host.data_ptr()
    assert int(addrs[-1, -1]) == host.data_ptr() + host.numel() - lay.run_bytes


def test_kernel_blocks_smaller_than_vllm_blocks() -> None:
    # The kernel splits each vLLM block into 2: the tensor has 2 * NB blocks.
    buf = torch.randn(1, 2 * NB, H, N // 2, 2 * D)
    lay = build_layout(layers_of(buf), NB, _layer_index, 1)
    assert lay.runs == 1 and lay.run_bytes == 2 * H * (N // 2) * 2 * D * 4
    a = lay.layers[0].addrs(np.array([3]))
    assert int(a[0, 0]) == buf[0, 6].data_ptr()
