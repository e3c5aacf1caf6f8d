"""The QSA backward tests' oracle (tests/gpu/test_qsa_backward.py, tests/test_qsa_backward_kernels.py): dense FP64
QSA over a [T, T] matrix of slot counts, and gradients by autograd of a loss in which every output (out, out_fp32,
lse) takes part. CPU or CUDA: everything follows the inputs' device."""

from __future__ import annotations

import torch


def slot_counts(ids: torch.Tensor, t: int) -> torch.Tensor:
    """[T, T] FP64: how many slots of row t name token u (ids outside [0, T) name nothing)."""
    idl = ids.long()
    valid = (idl >= 0) & (idl < t)
    cnt = torch.zeros(t, t, dtype=torch.float64, device=ids.device)
    return cnt.scatter_add_(1, torch.where(valid, idl, 0), valid.double())


def dense_oracle(q, k, v, cnt, scale):
    """Dense QSA, each key weighted by its count in the row (a repeated id counts once per slot): (out [T, Hq, Dv],
    lse [Hq, T]); a row without keys gives out 0 and lse -inf. Differentiable and NaN-free on such rows."""
    g = q.shape[1] // k.shape[1]
    kh, vh = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("thd,uhd->htu", q, kh) * scale
    s = s.masked_fill(cnt[None] == 0, float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m) * cnt[None]
    z = e.sum(-1)
    zs = torch.where(z > 0, z, torch.ones_like(z))
    lse = torch.where(z > 0, m[..., 0] + torch.log(zs), torch.full_like(z, float("-inf")))
    return torch.einsum("htu,uhd->thd", e / zs[..., None], vh), lse


def loss_weights(t: int, hq: int, dv: int, gen: torch.Generator, device) -> tuple:
    """Random FP32 weights of out, out_fp32 and lse in `loss`."""
    return tuple(x.to(device) for x in (torch.randn(t, hq, dv, generator=gen), torch.randn(t, hq, dv, generator=gen),
                                        torch.randn(hq, t, generator=gen)))


def loss(outs, weights):
    """sum(out w0) + sum(out_fp32 w1) + sum(lse w2) in FP64, lse's -inf rows left out."""
    out, out32, lse = outs
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w_out, w_out32, w_lse = (w.double() for w in weights)
    return (out.double() * w_out).sum() + (out32.double() * w_out32).sum() + (finite.double() * w_lse).sum()


def grads(fn, q, k, v, weights):
    """(dq, dk, dv) of loss(fn(q, k, v)) by autograd, on fresh leaves."""
    qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    loss(fn(qq, kk, vv), weights).backward()
    return qq.grad, kk.grad, vv.grad


def oracle_grads(q, k, v, cnt, scale, weights):
    """Autograd of dense_oracle in FP64 (out and out_fp32 are the same values there)."""
    def fn(a, b, c):
        out, lse = dense_oracle(a, b, c, cnt, scale)
        return out, out, lse
    return grads(fn, q.double(), k.double(), v.double(), weights)
