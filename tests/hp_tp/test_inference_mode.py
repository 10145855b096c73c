# mypy: disable-error-code="attr-defined,union-attr,arg-type,no-untyped-def,index,operator,call-arg,misc,assignment"
# (tests drive DTensors through torch APIs typed for plain tensors)
"""Every TP style, and loss parallel, under ``torch.inference_mode()`` on 2 gloo ranks: the same
values as under ``no_grad`` and as one process (float64), whether the input is an inference tensor
or a normal one; a model used for inference still trains afterwards (nothing made under inference
mode leaks into training); and the input-annotation cache never returns a stale result for an input
changed in place, in any mode."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from hp_dtensor.testing import RankPool, rank_pool_fixture

pool2 = rank_pool_fixture(2, timeout=180)

TOL = {"rtol": 1e-12, "atol": 1e-12}


def _case(name: str, world: int, rank: int) -> tuple[Any, Any, Any, Any, Any]:
    """(reference module, parallelized copy, make_inputs(gen) -> (global args, this rank's args),
    to_global(output) -> global tensor, reference output -> what to_global is compared with)."""
    import torch
    from torch import nn

    from hp_dtensor import DTensor, Replicate, Shard, init_device_mesh
    from hp_tp import (
        ColwiseParallel,
        NoParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    f64 = torch.float64
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)

    def replicated(gen: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        x = torch.randn(3, 8, dtype=f64, generator=gen)
        return (x,), (x.clone(),)

    def seq_sharded(gen: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        x = torch.randn(2, 4, 8, dtype=f64, generator=gen)
        return (x,), (x.chunk(world, 1)[rank].clone(),)

    def plain(y: Any) -> Any:
        return y.full_tensor() if isinstance(y, DTensor) else y

    def gather(dim: int) -> Any:
        def to_global(y: Any) -> Any:
            if isinstance(y, DTensor):
                return y.full_tensor()
            return DTensor.from_local(y, mesh, [Shard(dim)], run_check=False).full_tensor()
        return to_global

    same = lambda r: r  # noqa: E731

    if name == "colwise_rowwise_mlp":
        ref = nn.Sequential(nn.Linear(8, 16, dtype=f64), nn.ReLU(), nn.Linear(16, 8, dtype=f64))
        plan: Any = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        return ref, parallelize_module(copy.deepcopy(ref), mesh, plan), replicated, plain, same

    if name == "colwise_rowwise_bias_and_sequence_sharded_swiglu":
        class SwiGLU(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.norm = nn.LayerNorm(8, dtype=f64)
                self.gate = nn.Linear(8, 12, bias=False, dtype=f64)
                self.up = nn.Linear(8, 12, dtype=f64)
                self.down = nn.Linear(12, 8, dtype=f64)

            def forward(self, x: Any) -> Any:
                h = self.norm(x)
                return self.down(nn.functional.silu(self.gate(h)) * self.up(h))

        ref = SwiGLU()
        plan = {"norm": SequenceParallel(), "gate": ColwiseParallel(input_layouts=Shard(1)),
                "up": ColwiseParallel(input_layouts=Shard(1)), "down": RowwiseParallel(output_layouts=Shard(1))}
        return ref, parallelize_module(copy.deepcopy(ref), mesh, plan), seq_sharded, gather(1), same

    if name == "sequence_sharded_swiglu_shared_input":
        # gate and up read the caller's own sequence-sharded tensor: the annotation cache can share its
        # gather (a DTensor input, such as a SequenceParallel norm's output, is redistributed per use)
        class SharedInputSwiGLU(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.gate = nn.Linear(8, 12, bias=False, dtype=f64)
                self.up = nn.Linear(8, 12, dtype=f64)
                self.down = nn.Linear(12, 8, dtype=f64)

            def forward(self, x: Any) -> Any:
                return self.down(nn.functional.silu(self.gate(x)) * self.up(x))

        ref = SharedInputSwiGLU()
        plan = {"gate": ColwiseParallel(input_layouts=Shard(1)), "up": ColwiseParallel(input_layouts=Shard(1)),
                "down": RowwiseParallel(output_layouts=Shard(1))}
        return ref, parallelize_module(copy.deepcopy(ref), mesh, plan), seq_sharded, gather(1), same

    if name == "sequence_parallel_norm":
        ref = nn.LayerNorm(8, dtype=f64)
        return ref, parallelize_module(copy.deepcopy(ref), mesh, SequenceParallel()), seq_sharded, gather(1), same

    if name in ("rowwise_embedding", "colwise_embedding"):
        ref = nn.Embedding(10, 6, dtype=f64)
        style = RowwiseParallel(input_layouts=Replicate()) if name == "rowwise_embedding" else ColwiseParallel(
            output_layouts=Replicate())

        def ids(gen: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
            i = torch.randint(0, 10, (3, 5), generator=gen)
            return (i,), (i.clone(),)

        return ref, parallelize_module(copy.deepcopy(ref), mesh, style), ids, plain, same

    if name == "no_parallel":
        ref = nn.Linear(8, 4, dtype=f64)
        return ref, parallelize_module(copy.deepcopy(ref), mesh, NoParallel()), replicated, plain, same

    if name == "prepare_module_input_with_kwargs":
        class TwoInputs(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(8, 8, dtype=f64)

            def forward(self, x: Any, *, y: Any) -> Any:
                return self.lin(x) * y

        ref = TwoInputs()
        style = PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate(),
                                   input_kwarg_layouts={"y": Shard(0)},
                                   desired_input_kwarg_layouts={"y": Replicate()}, use_local_output=True)
        model = parallelize_module(copy.deepcopy(ref), mesh, style)

        def two(gen: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
            x, y = torch.randn(4, 8, dtype=f64, generator=gen), torch.randn(4, 8, dtype=f64, generator=gen)
            return (x, y), (x.chunk(world)[rank].clone(), y.chunk(world)[rank].clone())

        return ref, model, two, plain, same

    if name == "prepare_module_output":
        ref = nn.Linear(8, 8, dtype=f64)
        style = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))

        def even_rows(gen: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
            x = torch.randn(4, 8, dtype=f64, generator=gen)  # rows divide by the mesh: to_global is even
            return (x,), (x.clone(),)

        return ref, parallelize_module(copy.deepcopy(ref), mesh, style), even_rows, gather(0), same

    if name == "prepare_module_input_output_around_rowwise":
        ref = nn.Sequential(nn.Linear(8, 16, dtype=f64), nn.Tanh(), nn.Linear(16, 8, dtype=f64))
        # the root's style is applied by itself: a plan key names a submodule, never the root ('')
        model = parallelize_module(copy.deepcopy(ref), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        parallelize_module(model, mesh, PrepareModuleInputOutput(
            input_layouts=Shard(0), desired_input_layouts=Replicate(),
            output_layouts=Replicate(), desired_output_layouts=Shard(0)))

        def rows(gen: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
            x = torch.randn(4, 8, dtype=f64, generator=gen)
            return (x,), (x.chunk(world)[rank].clone(),)

        return ref, model, rows, gather(0), same

    if name == "loss_parallel":
        import torch.nn.functional as F

        from hp_tp import loss_parallel

        class Head(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lm_head = nn.Linear(8, 10, dtype=f64)

            def forward(self, x: Any, tgt: Any) -> Any:
                logits = self.lm_head(x)
                if isinstance(logits, DTensor):
                    with loss_parallel():
                        return F.cross_entropy(logits, tgt)
                return F.cross_entropy(logits, tgt)

        ref = Head()
        model = copy.deepcopy(ref)
        parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})

        def with_targets(gen: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
            x, t = torch.randn(6, 8, dtype=f64, generator=gen), torch.randint(0, 10, (6,), generator=gen)
            return (x, t), (x.clone(), t.clone())

        return ref, model, with_targets, plain, same

    raise AssertionError(name)


CASES = [
    "colwise_rowwise_mlp", "colwise_rowwise_bias_and_sequence_sharded_swiglu", "sequence_parallel_norm",
    "rowwise_embedding", "colwise_embedding", "no_parallel", "prepare_module_input_with_kwargs",
    "prepare_module_output", "prepare_module_input_output_around_rowwise", "loss_parallel",
]


def _call(model: Any, args: tuple[Any, ...], name: str) -> Any:
    if name == "prepare_module_input_with_kwargs":
        return model(args[0], y=args[1])
    return model(*args)


def _inference_equals_no_grad(rank: int, world: int, name: str) -> dict[str, Any]:
    import torch

    ref, model, make, to_global, _ = _case(name, world, rank)
    gen = torch.Generator().manual_seed(1)
    checked = 0
    for _ in range(2):  # a second call meets whatever the first one cached
        glob, local = make(gen)
        with torch.no_grad():
            want = _call(ref, glob, name)
            no_grad = to_global(_call(model, local, name))
        torch.testing.assert_close(no_grad, want, **TOL)
        with torch.inference_mode():
            # inputs made under inference mode (what an eval loop feeds) ...
            inf_local = tuple(a.clone() for a in local)
            assert all(a.is_inference() for a in inf_local)
            out = _call(model, inf_local, name)
            got = to_global(out)
            # ... and normal tensors made outside it
            got_normal = to_global(_call(model, local, name))
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(got_normal, want, **TOL)
        torch.testing.assert_close(got, no_grad, rtol=0, atol=0)
        checked += 3
    # Training after inference: nothing inference mode made is reused where autograd needs it.
    glob, local = make(gen)
    want = _call(ref, glob, name)
    out = _call(model, local, name)
    to_global(out).sum().backward()
    want.sum().backward()
    for (pname, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(g, q.grad, **TOL, msg=pname)
        checked += 1
    return {"checked": checked}


@pytest.mark.parametrize("name", CASES)
def test_inference_mode_equals_no_grad_and_one_process(pool2: RankPool, name: str) -> None:
    results = pool2.run(_inference_equals_no_grad, name)
    print(f"{name}: {sum(r['checked'] for r in results)} comparisons against one process")


def _cache_is_never_stale(rank: int, world: int) -> dict[str, Any]:
    """gate and up share one input (sequence-sharded, gathered once where the input keeps a version
    counter); the input is changed in place between calls, in every mode, and each call must see
    the new values."""
    import torch

    from hp_dtensor import CommDebugMode

    ref, model, make, to_global, _ = _case("sequence_sharded_swiglu_shared_input", world, rank)
    gen = torch.Generator().manual_seed(2)
    (x,), (xl,) = make(gen)
    gathers: dict[str, int] = {}
    modes = {
        "grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_normal_input": torch.inference_mode,
    }
    for mode_name, mode in modes.items():
        for _ in range(2):
            with mode():
                with CommDebugMode() as comm:
                    got = to_global(model(xl))
                want = ref(x)
            torch.testing.assert_close(got.detach(), want.detach(), **TOL, msg=mode_name)
            gathers[mode_name] = comm.get_comm_counts().get("all_gather", 0)
            with torch.no_grad():
                xl.mul_(1.5).add_(0.25)  # in place: the same tensor object, new values
                x.mul_(1.5).add_(0.25)
    with torch.inference_mode():
        xi, x2 = xl.clone(), x.clone()  # an inference tensor: no version counter to key a cache on
        for _ in range(2):
            with CommDebugMode() as comm:
                got = to_global(model(xi))
            torch.testing.assert_close(got, ref(x2), **TOL)
            gathers["inference_input"] = comm.get_comm_counts().get("all_gather", 0)
            xi.mul_(1.5).add_(0.25)
            x2.mul_(1.5).add_(0.25)
    return gathers


def test_annotation_cache_never_returns_a_stale_input(pool2: RankPool) -> None:
    for r in pool2.run(_cache_is_never_stale):
        # one gather of the shared input plus the output's own (to_global), where the input has a
        # version counter; an inference-tensor input is gathered per consumer, as torch's styles do
        assert r == {"grad": 2, "no_grad": 2, "inference_normal_input": 2, "inference_input": 3}, r
