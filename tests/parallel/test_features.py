"""Every training feature x placement traces, stores, loads and matches eager PyTorch
(DDP for replicate, FSDP2 fully_shard for shard and HSDP) after 5 steps, on real gloo ranks; so
does ``nn.TransformerEncoder`` given a causal mask and no ``is_causal`` hint."""

import pytest
import torch

import spmd_aot
from support.features import FEATURES
from support.multiproc import run_launches, run_ranks

STEPS = 5


def _all_features_worker(rank, world, variants, cache_dir):
    import traceback

    from support import features

    out = {}
    for feature in features.FEATURES:
        for variant in variants:
            try:
                ref = features.reference(feature, variant, rank, world, STEPS)
                got = features.compiled(feature, variant, rank, world, STEPS, f"{cache_dir}/{feature}-{variant}")
                out[feature, variant] = features.max_diffs(ref[0], ref[1], got[0], got[1], ref[2], got[2])
            except Exception as exc:
                out[feature, variant] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
    return out


WORLD_VARIANTS = {2: ["replicate", "shard", "shard_keep_1d_whole"],
                  4: ["replicate", "shard", "hsdp", "hsdp_keep_1d_whole"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One launch per world size (each rank starts once), both at the same time: while one
    launch's rank 0 traces, the other's ranks use the other CPU. Checked feature by feature below."""
    cache = tmp_path_factory.mktemp("features")
    launches = [(_all_features_worker, world, variants, str(cache / f"w{world}"))
                for world, variants in WORLD_VARIANTS.items()]
    return dict(zip(WORLD_VARIANTS, run_launches(*launches, timeout=600)))


CASES = [(w, f, v) for w, vs in WORLD_VARIANTS.items() for f in FEATURES for v in vs]


@pytest.mark.parametrize("world,feature,variant", CASES)
def test_feature_matches_eager(results, world, feature, variant):
    tolerance = FEATURES[feature][4]
    for rank, per_rank in enumerate(results[world]):
        diffs = per_rank[feature, variant]
        assert isinstance(diffs, dict), f"rank {rank}: {diffs}"
        assert diffs["param"] <= tolerance and diffs["state"] <= tolerance and diffs["loss"] <= tolerance, \
            f"rank {rank}: {diffs}"


# ---------------------------------------------------------------------------- nn.TransformerEncoder with a mask
class CausalEncoderLM(torch.nn.Module):
    """``nn.TransformerEncoder`` given ``generate_square_subsequent_mask`` and no ``is_causal``:
    eager reads the mask's values to detect that it is causal; the traced step uses it as given."""

    def __init__(self, vocab=24, d=16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        layer = torch.nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, idx):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        return self.head(self.encoder(self.emb(idx), mask=mask))


def _encoder_batch(rank=0, step=0):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randint(0, 24, (2, 6), generator=g), torch.randint(0, 24, (2, 6), generator=g)


def _encoder_objects():
    torch.manual_seed(0)
    model = CausalEncoderLM()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _encoder_worker(rank, world, cache_dir):
    from torch.nn.parallel import DistributedDataParallel

    from spmd_aot.examples.models import train_step

    ref_model, _ = _encoder_objects()
    ddp = DistributedDataParallel(ref_model)
    ref_optim = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ref_losses = [train_step(ddp, ref_optim, _encoder_batch(rank, s)).detach() for s in range(STEPS)]
    model, optim = _encoder_objects()
    step = spmd_aot.compile(train_step, cache_dir=cache_dir, require_hit=True)
    losses = [step(model, optim, _encoder_batch(rank, s)).detach() for s in range(STEPS)]
    params = max((a - b).abs().max().item() for a, b in zip(ref_model.parameters(), model.parameters()))
    return params, max((a - b).abs().item() for a, b in zip(ref_losses, losses)), step.cache_info.traces


def test_transformer_encoder_with_a_causal_mask_and_no_hint_matches_eager_ddp(tmp_path):
    """The causal-mask detection's answer is a hint (torch: is_causal=False for a causal mask
    "may lead to reduced performance" only), so the build uses the mask as given
    (``tracing/causal_masks.py``) and the loaded step matches eager DDP, which took the hint."""
    from spmd_aot.examples.models import train_step

    job = spmd_aot.Job(step=train_step, model=lambda: _encoder_objects()[0], batch=_encoder_batch,
                       optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    spmd_aot.build(job, world_size=2, cache_dir=str(tmp_path))
    for params, loss, traces in run_ranks(_encoder_worker, 2, str(tmp_path)):
        assert traces == 0 and params <= 1e-5 and loss <= 1e-5, (params, loss, traces)
