"""Serve prompts in phases with vLLM's ``LLM`` and KV offloading; write outputs, offloading
metrics and disk-tier files after each phase as JSON.

Usage: ``python tests/kv_offload_harness.py SPEC.json OUT.json`` where SPEC holds
``{"model": str, "engine": {LLM kwargs}, "prompts": {name: {"seed": int, "tokens": int}},
"phases": [{"prompt": name, "max_tokens": int, "corrupt": path?}], "disk_dir": str | null}``;
``corrupt`` names a file under ``disk_dir`` whose payload gets one bit flipped before the
phase runs. Prompts are lists
of made-up facts ending with a question about one of them, about ``tokens`` tokens long, so
the answer depends on the whole context. With a disk tier, each phase waits until the tier's
files stop changing (stores reach the disk asynchronously).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

_NAMES = ["amber", "basil", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo",
          "juniper", "kestrel", "lagoon", "meadow", "nectar", "onyx", "pepper", "quartz",
          "raven", "saffron", "tundra", "umber", "velvet", "willow", "yarrow", "zephyr"]


def facts_prompt(tokenizer, seed: int, tokens: int) -> list[int]:
    """Token ids of ``"Fact i: the code of <name>-<n> is <number>. ..."`` lines, about
    ``tokens`` long, then a question about the first fact."""
    rng = random.Random(seed)
    lines, first = [], None
    question = ""
    while True:
        name = f"{rng.choice(_NAMES)}-{rng.randrange(1000)}"
        code = rng.randrange(10_000, 99_999)
        first = first or (name, code)
        lines.append(f"Fact {len(lines) + 1}: the code of {name} is {code}.")
        question = f"\nQuestion: what is the code of {first[0]}?\nAnswer: the code of {first[0]} is"
        ids = tokenizer.encode("\n".join(lines) + question)
        if len(ids) >= tokens:
            return ids


def disk_files(root: str | None) -> list[str]:
    """Block files under ``root``, relative paths, sorted."""
    if not root or not os.path.isdir(root):
        return []
    out = []
    for dirpath, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(dirpath, n), root) for n in names
                if n.endswith(".bin")]
    return sorted(out)


def wait_disk_settled(root: str | None, quiet_s: float = 2.0, timeout_s: float = 120.0) -> None:
    """Wait until the set of block files has not changed for ``quiet_s`` seconds."""
    if not root:
        return
    deadline = time.monotonic() + timeout_s
    last, since = disk_files(root), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = disk_files(root)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return


def flip_bit(path: str, offset: int) -> None:
    """Flip the lowest bit of the byte at ``offset`` of ``path``, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def metrics(llm) -> dict[str, float]:
    """Counters and gauges as ``name{label=value,...}`` -> value (model/engine labels dropped)."""
    out = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if value is None:
            continue
        labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items())
                          if k not in ("model_name", "engine"))
        out[f"{m.name}{{{labels}}}" if labels else m.name] = value
    return out


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], disable_log_stats=False, **spec.get("engine", {}))
    tokenizer = llm.get_tokenizer()
    prompts = {name: facts_prompt(tokenizer, p["seed"], p["tokens"])
               for name, p in spec["prompts"].items()}
    phases = []
    for phase in spec["phases"]:
        if phase.get("corrupt"):
            flip_bit(os.path.join(spec["disk_dir"], phase["corrupt"]), offset=4096 + 1000)
        ids = prompts[phase["prompt"]]
        params = SamplingParams(temperature=0, max_tokens=phase["max_tokens"])
        start = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        wait_disk_settled(spec.get("disk_dir"))
        phases.append({"prompt": phase["prompt"], "num_prompt_tokens": len(ids),
                       "token_ids": list(res.outputs[0].token_ids), "text": res.outputs[0].text,
                       "seconds": seconds, "metrics": metrics(llm),
                       "disk_files": disk_files(spec.get("disk_dir"))})
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"phases": phases}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
