"""The real-model corpus: transformers decoder LMs (GPT-2, Llama, Mistral, Qwen3, Gemma, Gemma 2,
Phi-3, GPT-NeoX, BLOOM), MoE (Mixtral, Qwen2-MoE), encoder-decoders (T5, Whisper), BERT,
CLIP, Mamba, vision (ViT, Swin, ConvNeXt, ResNet), a peft LoRA model and our nanoGPT- and
torchtitan-style models, built with the CLI, loaded with ``require_hit=True`` on 2 gloo ranks
(0 traces) and compared with eager DDP / ``fully_shard`` / ``parallelize_module`` after 5 AdamW
steps. Run alone with ``pytest -m corpus``."""

from __future__ import annotations

import io
import json
import os
import pathlib
import subprocess
import sys

import pytest

from spmd_aot.cli.app import main

pytestmark = pytest.mark.corpus
from support import corpus  # noqa: E402  (needs transformers: a test dependency, `pip install -e ".[test]"`)

TESTS = pathlib.Path(__file__).resolve().parents[1]  # the tests root: support/ is under it

# Known failures, each with its cause; strict: a fix makes the test fail until the mark goes.
# A model name marks every test of that model; (name, configuration) marks one loaded case.
KNOWN: dict = {}


def test_every_known_failure_names_a_corpus_case():
    """A mark on a name the corpus does not run would never flip: each one names a model, or a
    model and one of its configurations."""
    cases = set(corpus.cases())
    assert [k for k in KNOWN if k not in corpus.MODELS and k not in cases] == []


@pytest.fixture(scope="module")
def corpus_run(tmp_path_factory) -> corpus.CorpusRun:
    return corpus.run_corpus(tmp_path_factory.mktemp("corpus"))


def _known(name, config=None):
    reason = KNOWN.get(name) or KNOWN.get((name, config))
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


BUILT = [n for n in corpus.MODELS if n != "mixtral_loop"]


@pytest.mark.parametrize("name", [pytest.param(n, marks=_known(n)) for n in BUILT])
def test_cli_builds_replicate_and_shard(corpus_run, name):
    built = corpus_run.builds[name, "replicate"]
    assert built.ok, built.output
    rows = [line for line in built.output.splitlines() if line.startswith("world=2 ")]
    assert [row.split()[-1] for row in rows] == ["built", "built"], built.output  # both traced


@pytest.mark.parametrize("name,config", [pytest.param(n, c, marks=_known(n, c))
                                         for n, c in corpus.cases(BUILT)])
def test_loaded_step_matches_eager(corpus_run, name, config):
    """Every rank hit the cache, traced nothing, and ended within tolerance of eager: parameters
    and buffers, optimizer state and the 5 losses (outputs, for the eval step and the wrapper)."""
    built = corpus_run.builds[name, config]
    assert built.ok, built.output
    per_rank = corpus_run.results[name, config]
    assert len(per_rank) == (4 if config == "fsdp_tp" else 2)
    problems = {rank: corpus.verdict(r) for rank, r in enumerate(per_rank) if corpus.verdict(r)}
    assert not problems, problems


def test_data_dependent_moe_routing_is_refused_at_build_naming_the_op(tmp_path):
    """Mixtral's loop over the experts that received tokens (``experts_implementation='eager'``)
    has shapes that depend on the routing: the build says so (exit 2, an spmd-aot error naming
    the experts module and ``nonzero``), it does not crash or store anything."""
    built = corpus.cli_build("mixtral_loop", str(tmp_path))
    assert built.rc == 2, built.output
    assert "model.layers.0.mlp.experts (MixtralExperts)" in built.output, built.output
    assert "aten.nonzero" in built.output, built.output


def test_a_written_plan_naming_modules_the_model_lacks_is_refused_naming_hf(tmp_path):
    """Qwen2-MoE's own plan names the dense MLP's projections (layers.*.mlp.gate_proj, ...), which
    its MoE layers lack. Written out as a dict, the build refuses it naming the patterns and
    ``tp_plan='hf'`` (exit 2); the corpus's Qwen2-MoE TP case passes ``'hf'``, as the message says."""
    plan = dict(corpus.factory("qwen2_moe")().config.base_model_tp_plan)
    built = corpus.api_build("qwen2_moe", str(tmp_path), world_size=2, placement="replicate", tp_plan=plan)
    assert built.rc == 2, built.output
    first = built.output.splitlines()[0]
    assert "layers.*.mlp.gate_proj" in first and "tp_plan='hf'" in first, built.output
    assert corpus.compile_options("qwen2_moe", "tp")["tp_plan"] == "hf"


# ---------------------------------------------------------------------------- keys
_KEYS = """
import json, sys
from support import corpus
from spmd_aot import Plan
from spmd_aot.building.builder import job_key
keys = {f"{n}/{p}": job_key(corpus.job(n), Plan(2, p)) for n in corpus.MODELS for p in ("replicate", "shard")}
print("KEYS " + json.dumps({name: {"key": k.key, **k.ingredients} for name, k in keys.items()}))
"""


def test_every_key_is_the_same_under_different_hash_seeds():
    """transformers objects hold process-random state (``GenerationConfig._original_object_hash``,
    set iteration order): the key must not see it, or a job would never hit its own build."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS)])
    procs = [subprocess.Popen([sys.executable, "-c", _KEYS], cwd=TESTS, env={**env, "PYTHONHASHSEED": seed},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in ("1", "2")]
    keys = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        keys.append(json.loads(next(line[5:] for line in out.splitlines() if line.startswith("KEYS "))))
    assert len(keys[0]) == 2 * len(corpus.MODELS)
    differing = {name: sorted(i for i in key if key[i] != keys[1][name][i]) for name, key in keys[0].items()}
    assert {name: d for name, d in differing.items() if d} == {}  # model -> the ingredients that differ


# config fields forward reads, changed between the build and the job
def gpt2_eps():
    return corpus.job("gpt2", layer_norm_epsilon=1e-6)


def llama_eps():
    return corpus.job("llama", rms_norm_eps=1e-5)


@pytest.mark.parametrize("name,target,field", [("gpt2", "gpt2_eps", "layer_norm_epsilon"),
                                               ("llama", "llama_eps", "rms_norm_eps")])
def test_a_config_field_forward_reads_changes_the_key(corpus_run, name, target, field):
    """The built cache answers the unchanged job with a hit and the changed one with a miss
    (``spmd-aot explain``: exit 0, then exit 1 naming the field)."""
    cache = corpus_run.builds[name, "replicate"].cache

    def explain(t):
        out, saved = io.StringIO(), (sys.stdout, sys.stderr)
        sys.stdout = sys.stderr = out
        try:
            return main(["explain", t, "-w", "2", "--cache-dir", cache]), out.getvalue()
        finally:
            sys.stdout, sys.stderr = saved

    rc, out = explain(f"support.corpus:{name}")
    assert rc == 0, out
    rc, out = explain(f"test_corpus:{target}")
    assert rc == 1 and field in out, out


def bare_gpt2_spmd():
    return corpus.spmd_job(bare=True)


def test_wrapping_a_model_that_returns_a_model_output_is_refused_at_build(tmp_path):
    """GPT-2 returns transformers' ``CausalLMOutputWithCrossAttentions`` holding a ``DynamicCache``
    in eval (``use_cache=False``: the ModelOutput class itself is refused): the SPMD wrapper's
    build names the type (exit 2) rather than storing a graph whose output it cannot rebuild.
    (``config.return_dict=False`` is no way out: transformers 5.25's GPT2LMHeadModel then fails
    reading ``.last_hidden_state`` off a tuple, in eager too.)"""
    built = corpus.cli_build("bare_gpt2_spmd", str(tmp_path), placements=("replicate",),
                             target_module="test_corpus")
    assert built.rc == 2 and "the step returns a DynamicCache" in built.output, built.output


def test_the_default_attention_variants_run_sdpa():
    """The default rows are the SDPA variants (transformers 5 resolves the default to sdpa on
    CPU); the ``_eager`` rows run the eager attention."""
    impl = {name: corpus.factory(name)().config._attn_implementation
            for name in ("gpt2", "gpt2_eager", "llama", "llama_eager")}
    assert impl == {"gpt2": "sdpa", "gpt2_eager": "eager", "llama": "sdpa", "llama_eager": "eager"}
