"""Code that reads tensor values on the host is refused at build time in one line naming the
construct, the user's file, line and code, the module, and a rewrite; each rewrite the message
names builds and computes what the refused code computed."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spmd_aot
from spmd_aot.tracing import data_dependent

VOCAB, N, T = 8, 2, 6


class LossModel(nn.Module):
    """A model whose forward computes its loss, in one of several ways (``mode``): the ones the
    build refuses, and what their refusals say to write instead."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.emb, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

    def forward(self, idx, labels):  # noqa: C901  (one branch per case, each a line the tests quote)
        logits, labels = self.head(self.emb(idx)).flatten(0, 1), labels.flatten()
        keep = labels != -100
        if self.mode == "bool_index":
            return F.cross_entropy(logits[keep], labels[keep])
        if self.mode == "nonzero":
            rows = keep.nonzero().squeeze(1)
            return F.cross_entropy(logits[rows], labels[rows])
        if self.mode == "ignore_index":  # the rewrite of both
            return F.cross_entropy(logits, labels, ignore_index=-100)
        if self.mode == "masked_select":
            return torch.masked_select(logits.square().mean(-1), keep).mean()
        if self.mode == "masked_mean":  # its rewrite
            return (logits.square().mean(-1) * keep).sum() / keep.sum()
        if self.mode == "unique":
            return logits[:, torch.unique(labels.clamp(min=0))].sum()
        if self.mode == "one_hot":  # its rewrite
            return (logits * F.one_hot(labels.clamp(min=0), VOCAB).amax(0)).sum()
        if self.mode == "item":
            return F.cross_entropy(logits, labels, ignore_index=-100) * keep.sum().item()
        if self.mode == "tensor":  # its rewrite
            return F.cross_entropy(logits, labels, ignore_index=-100) * keep.sum()
        if self.mode == "branch":
            if keep.all():
                return F.cross_entropy(logits, labels)
            return F.cross_entropy(logits, labels, ignore_index=-100) * 2
        if self.mode == "where":  # its rewrite
            return torch.where((~keep).sum() == 0, F.cross_entropy(logits, labels.clamp(min=0)),
                               F.cross_entropy(logits, labels, ignore_index=-100) * 2)
        if self.mode == "equal":
            return F.cross_entropy(logits, labels, ignore_index=-100) * torch.equal(labels, labels.clamp(min=-100))
        if self.mode == "tensor_equal":  # its rewrite
            return F.cross_entropy(logits, labels, ignore_index=-100) * ~(labels != labels.clamp(min=-100)).any()
        if self.mode == "repeat":
            return logits[:, 0].repeat_interleave(keep.long()).sum()
        if self.mode == "repeat_masked":  # its rewrite (each count at most 1)
            return torch.where(keep, logits[:, 0], 0).sum()
        if self.mode == "assert":
            assert keep.any()
            return F.cross_entropy(logits, labels, ignore_index=-100)
        raise ValueError(self.mode)


def _step(model, optim, batch):
    loss = model(*batch)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _batch():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, VOCAB, (N, T), generator=g)
    labels[0, :2] = -100  # ignored positions
    return torch.randint(0, VOCAB, (N, T), generator=g), labels


def _job(mode):
    return spmd_aot.Job(step=_step, model=lambda: LossModel(mode), batch=_batch,
                        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))


def _refusal(job, tmp_path) -> str:
    with pytest.raises(spmd_aot.UnsupportedError) as info:
        spmd_aot.build(job, world_size=2, cache_dir=str(tmp_path))
    message = str(info.value)
    assert "\n" not in message, message
    return message


# mode -> (what the message says was written, the quoted line, the rewrite it names, the rewrite's mode)
CASES = {
    "bool_index": ("indexes with a boolean mask", "return F.cross_entropy(logits[keep], labels[keep])",
                   "F.cross_entropy(logits, labels, ignore_index=-100)", "ignore_index"),
    "nonzero": ("calls `nonzero()`", "rows = keep.nonzero().squeeze(1)",
                "F.cross_entropy(logits, labels, ignore_index=-100)", "ignore_index"),
    "masked_select": ("calls `masked_select`", "torch.masked_select(logits.square().mean(-1), keep).mean()",
                      "(x * mask).sum() / mask.sum()", "masked_mean"),
    "unique": ("calls `torch.unique`", "torch.unique(labels.clamp(min=0))", "F.one_hot(x, n).amax(0)", "one_hot"),
    "item": ("reads a tensor's value on the host", "* keep.sum().item()", "keep it a 0-dim tensor", "tensor"),
    "branch": ("branches on a tensor's value", "if keep.all():", "torch.where(cond, a, b)", "where"),
    "equal": ("calls `torch.equal`", "torch.equal(labels, labels.clamp(min=-100))", "~(a != b).any()", "tensor_equal"),
    "repeat": ("calls `repeat_interleave` with tensor repeats", "logits[:, 0].repeat_interleave(keep.long()).sum()",
               "torch.where(mask, x, 0)", "repeat_masked"),
    "assert": ("asserts on a tensor's value", "assert keep.any()", "outside the compiled step", None),
}


def _line_of(code: str) -> int:
    source = open(__file__).read().splitlines()
    return next(i for i, line in enumerate(source, 1) if code in line and "CASES" not in line and '"' not in line)


@pytest.mark.parametrize("mode", list(CASES))
def test_refusal_names_construct_line_module_and_rewrite(tmp_path, mode):
    wrote, code, rewrite, _ = CASES[mode]
    message = _refusal(_job(mode), tmp_path)
    assert message.startswith(f"the step {wrote}"), message
    assert f"test_data_dependent.py:{_line_of(code)} `" in message and code in message, message
    assert "in module <root> (LossModel)" in message and rewrite in message, message
    assert "without host synchronisation" in message


@pytest.mark.parametrize("mode", [m for m in CASES if CASES[m][3]])
def test_the_named_rewrite_builds_and_computes_the_same(tmp_path, mode):
    rewritten = CASES[mode][3]
    spmd_aot.build(_job(rewritten), world_size=2, cache_dir=str(tmp_path))
    torch.manual_seed(0)
    refused = LossModel(mode)
    torch.manual_seed(0)
    written = LossModel(rewritten)
    assert torch.allclose(refused(*_batch()), written(*_batch()), rtol=1e-6, atol=0)


LIBRARY = '''
import torch


def route(x):
    return x[x > 0].sum()
'''


class UsesLibrary(nn.Module):
    """Calls an installed library's function that indexes with a boolean mask."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, labels):
        import fake_installed_library

        return fake_installed_library.route(self.fc(x)) + 0 * labels.sum()


def test_a_line_in_an_installed_library_is_named_with_the_users_line_that_called_it(tmp_path, monkeypatch):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "fake_installed_library.py").write_text(LIBRARY)
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    monkeypatch.setattr(data_dependent, "_INSTALLED_DIRS", (str(tmp_path / "lib") + "/",))
    importlib.invalidate_caches()
    monkeypatch.delitem(sys.modules, "fake_installed_library", raising=False)
    job = spmd_aot.Job(step=_step, model=UsesLibrary, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                       batch=lambda: (torch.randn(2, 4), torch.zeros(2)))
    message = _refusal(job, tmp_path / "cache")
    assert "fake_installed_library.py:6 `return x[x > 0].sum()`" in message, message
    called_from = f"(called from {__file__}:{_line_of('fake_installed_library.route(self.fc(x))')} `"
    assert called_from in message, message
    assert "the line is in an installed library: choose its static-shape option" in message, message
