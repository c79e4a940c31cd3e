"""Which SDPA kernel eager picks on this device, over the shapes and flags that decide it.

    python tools/bench/sdpa_choice.py                  # cuda when visible, else cpu
    python tools/bench/sdpa_choice.py --json out.json  # the same table as data

A build without a GPU records math attention, because ``aten::_fused_sdp_choice`` answers MATH
when no device can be queried. What eager runs on a real GPU depends on the torch release, the
GPU, the runtime cuDNN and the call (dtype, head dim, mask, dropout, GQA, causal, lengths), and
only a process that sees the GPU can answer. This prints that answer for a grid of calls, plus
the facts it depends on, so a build for an assumed target can be checked against it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch


def facts(device: str) -> dict:
    out = {"torch": torch.__version__, "device": device, "cuda_build": torch.version.cuda}
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
        out["capability"] = "sm{}{}".format(*torch.cuda.get_device_capability(0))
        out["cudnn"] = torch.backends.cudnn.version()
    out["flags"] = {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")()
                    for name in ("flash", "mem_efficient", "math", "cudnn")}
    out["deterministic"] = torch.are_deterministic_algorithms_enabled()
    return out


def grid():
    """(label, call kwargs) over what the choice reads; batch 2, 8 query heads."""
    for dtype, head_dim, seq, mask, dropout, gqa in itertools.product(
            ("float32", "bfloat16", "float16"), (16, 32, 64, 128, 256), (64, 1024),
            ("causal", "none", "bool", "float"), (0.0, 0.1), (False, True)):
        yield dict(dtype=dtype, head_dim=head_dim, seq=seq, mask=mask, dropout=dropout, gqa=gqa)


def choose(device: str, c: dict) -> str:
    from torch.nn.attention import SDPBackend

    dtype = getattr(torch, c["dtype"])
    heads, kv_heads = 8, (2 if c["gqa"] else 8)
    q = torch.randn(2, heads, c["seq"], c["head_dim"], dtype=dtype, device=device)
    kv = torch.randn(2, kv_heads, c["seq"], c["head_dim"], dtype=dtype, device=device)
    mask = None
    if c["mask"] == "bool":
        mask = torch.ones(c["seq"], c["seq"], dtype=torch.bool, device=device).tril()
    elif c["mask"] == "float":
        mask = torch.zeros(c["seq"], c["seq"], dtype=dtype, device=device)
    try:
        return SDPBackend(torch._fused_sdp_choice(q, kv, kv, attn_mask=mask, dropout_p=c["dropout"],
                                                  is_causal=c["mask"] == "causal",
                                                  enable_gqa=c["gqa"])).name
    except Exception as exc:  # noqa: BLE001 - reported as the answer
        return f"error {type(exc).__name__}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="also write the table here")
    a = p.parse_args(argv)
    found = facts(a.device)
    rows = [dict(c, backend=choose(a.device, c)) for c in grid()]
    print("# " + json.dumps(found))
    print("| dtype | head dim | seq | mask | dropout | GQA 8/2 | backend |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['head_dim']} | {r['seq']} | {r['mask']} | {r['dropout']} | {r['gqa']} | "
              f"{r['backend']} |")
    counts: dict = {}
    for r in rows:
        counts.setdefault(r["dtype"], {}).setdefault(r["backend"], 0)
        counts[r["dtype"]][r["backend"]] += 1
    print("# per dtype: " + json.dumps(counts))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"facts": found, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
