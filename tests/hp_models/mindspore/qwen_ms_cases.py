# mypy: disable-error-code="no-untyped-def,no-untyped-call,import-not-found,import-untyped,attr-defined,arg-type,index,operator,union-attr,call-overload"
"""The runs the MindSpore Qwen3.5 tests compare: the torch model (the reference, already checked
against HF transformers) builds its weights from a seed, writes them as a HF safetensors
checkpoint, and returns logits, loss and every parameter gradient on a seeded batch; the
MindSpore model loads that checkpoint and returns the same figures.  Everything crosses as numpy
float32 arrays keyed by the parameter names both models share."""

from __future__ import annotations

import numpy as np

from hp_models.qwen3_5.config import Qwen3_5Config, tiny_config

BATCH, SEQ = 2, 37  # two chunks of the recurrence (chunk_size 32), the second one padded


def config(tie: bool) -> Qwen3_5Config:
    return tiny_config(tie_word_embeddings=tie)


def batch(seed: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, targets), each (BATCH, SEQ) int32."""
    rs = np.random.RandomState(1000 + seed)
    ids = rs.randint(0, vocab, size=(BATCH, SEQ + 1)).astype(np.int32)
    return ids[:, :-1].copy(), ids[:, 1:].copy()


def torch_reference(rank: int, world: int, seed: int, tie: bool, folder: str) -> dict[str, object]:
    """On a torch rank: the seeded, perturbed torch model saved to ``folder`` (HF layout), and its
    logits, mean cross-entropy loss and gradients on ``batch(seed)``."""
    import torch
    import torch.nn.functional as F

    from hp_models.qwen3_5 import Qwen3_5StateDictAdapter

    cfg = config(tie)
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # non-trivial norms, gates and decays
    if rank == 0:
        Qwen3_5StateDictAdapter(cfg).save_hf_state_dict(model.state_dict(), folder)
    ids, targets = batch(seed, cfg.vocab_size)
    logits = model(torch.from_numpy(ids).long())
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), torch.from_numpy(targets).long().reshape(-1))
    loss.backward()
    grads = {name: p.grad.numpy().copy() for name, p in model.named_parameters()}
    return {"logits": logits.detach().numpy(), "loss": float(loss.detach()), "grads": grads}


def ms_run(seed: int, tie: bool, folder: str) -> dict[str, object]:
    """The MindSpore model loaded from ``folder``: the same figures as ``torch_reference``."""
    import mindspore as ms
    from mindspore import Tensor, ops

    from hp_dtensor.platform import current
    from hp_models.qwen3_5.mindspore import Qwen3_5ForCausalLM, load_hf_weights

    cfg = config(tie)
    model = Qwen3_5ForCausalLM(cfg)
    model.verify_module_protocol()
    load_hf_weights(model, folder)
    ids, targets = batch(seed, cfg.vocab_size)
    # one name per parameter: a tied lm_head.weight is the embedding's (named first, as in torch)
    names: dict[int, str] = {}
    for name, p in current().state_dict(model).items():
        names.setdefault(id(p), name)
    params = list(model.get_parameters())

    def loss_fn(x, y):
        logits = model(x)
        return ops.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1)), logits

    (loss, logits), grads = ms.value_and_grad(loss_fn, None, params, has_aux=True)(Tensor(ids), Tensor(targets))
    return {
        "logits": logits.asnumpy(), "loss": float(loss.asnumpy()),
        "grads": {names[id(p)]: g.asnumpy() for p, g in zip(params, grads)},
    }


def worst(ref: np.ndarray, got: np.ndarray, rtol: float = 1.5e-4, atol: float = 1e-5) -> tuple[float, float]:
    """(max |got - ref|, the share of the tolerance used: max |got - ref| / (atol + rtol |ref|),
    below 1 where ``assert_allclose`` passes): the figures the report quotes."""
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64))
    return float(diff.max()), float((diff / (atol + rtol * np.abs(np.asarray(ref, np.float64)))).max())


def ms_tp_run(
    rank: int, world: int, seed: int, tie: bool, folder: str, sp: bool = False, lp: bool = False
) -> dict[str, object]:
    """On each MindSpore rank: the model loaded from ``folder``, parallelized over a ``world``-rank
    tp mesh by ``parallelize_qwen3_5_ms_tp`` (with sequence parallelism ``sp``, loss parallel
    ``lp``); the same figures as ``ms_run``, each gradient as this rank's local shard with its
    parameter's placements (the test assembles them), the logits whole, and the collectives of
    one forward by kind."""
    import mindspore as ms
    from mindspore import Tensor, ops

    from hp_dtensor import CommDebugMode, DTensor, init_device_mesh
    from hp_dtensor.platform import current
    from hp_models.qwen3_5.mindspore import Qwen3_5ForCausalLM, load_hf_weights, parallelize_qwen3_5_ms_tp
    from hp_tp import loss_parallel

    cfg = config(tie)
    model = Qwen3_5ForCausalLM(cfg)
    load_hf_weights(model, folder)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    parallelize_qwen3_5_ms_tp(model, mesh, sequence_parallel=sp, loss_parallel=lp)
    ids, targets = batch(seed, cfg.vocab_size)
    names: dict[int, str] = {}
    for name, p in current().state_dict(model).items():
        names.setdefault(id(p), name)
    params = list(model.get_parameters())

    def loss_fn(x, y):
        logits = model(x)
        if lp:
            with loss_parallel():
                loss = ops.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))
            return loss, logits.full_tensor()
        logits = logits.to_local() if isinstance(logits, DTensor) else logits
        return ops.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1)), logits

    with CommDebugMode() as comm:
        model(Tensor(ids))
    (loss, logits), grads = ms.value_and_grad(loss_fn, None, params, has_aux=True)(Tensor(ids), Tensor(targets))

    def plain(t):
        return (t.to_local() if isinstance(t, DTensor) else t).asnumpy()

    return {
        "logits": logits.asnumpy(), "loss": float(plain(loss)),
        "grads": {names[id(p)]: plain(g) for p, g in zip(params, grads)},
        "placements": {names[id(p)]: tuple(p.placements) if isinstance(p, DTensor) else None for p in params},
        "grad_types": sorted({type(g).__name__ for g in grads}),
        "forward_collectives": {str(k): v for k, v in comm.get_comm_counts().items()},
    }


def assemble(shards: list[np.ndarray], placements: tuple | None) -> np.ndarray:
    """The whole gradient from each rank's local shard of a 1-D tp mesh (even splits)."""
    from hp_dtensor import Shard

    if placements is None or not isinstance(placements[0], Shard):
        return shards[0]
    return np.concatenate(shards, axis=placements[0].dim)
