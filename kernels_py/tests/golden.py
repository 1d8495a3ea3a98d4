"""Golden results: every method on two small workloads, with the metrics the
ablation job reports, recorded from the code as it was when the file was last
written. test_golden.py reruns them, so a refactor that changes any number
shows. After an intended change of results, rewrite the file (and say why in
the commit):

    workbench python -- -m kernels_py.tests.golden --write
"""

import json
import sys
from pathlib import Path

PATH = Path(__file__).with_name("golden_ablation.json")
SMALL = {"layers": 2, "heads": 4, "kv_heads": 2, "tokens_per_image": 64, "text_tokens": 16,
         "decode_steps": 5, "salient_tokens": 8, "system_tokens": 8}
# The default dtype (float16), the same workload in float32 (exact arithmetic),
# and another seed and layout.
WORKLOADS = (SMALL, dict(SMALL, dtype="float32"), dict(SMALL, seed=3, dtype="float16", images=2, tokens_per_image=32))
CASES = [
    ("full", {}),
    ("h2o", {"budget": 0.3}),
    ("h2o", {"budget": 0.15, "recent_fraction": 0.25}),
    ("snapkv", {"budget": 0.3, "window": 8}),
    ("snapkv", {"budget": 0.1, "window": 8, "pooling": "max", "kernel_size": 3}),
    ("streamingllm", {"budget": 0.25}),
    ("streamingllm", {"budget": 0.05, "sink_tokens": 2}),
    ("vlcache", {"budget": 0.2}),
    ("vlcache", {"budget": 0.1, "allocation": "uniform", "scoring": "normalized", "recent_fraction": 0.0}),
    ("vlcache", {"budget": 0.3, "scoring": "sliding_window", "window": 8}),
    ("vlcache", {"budget": 0.05, "scoring": "accumulated"}),
    ("zipvl_evict", {"tau": 0.9, "probe_recent": 8, "probe_random": 8}),
    ("zipvl_evict", {"tau": 0.5}),
    ("zipvl", {"tau": 0.9, "probe_recent": 8, "probe_random": 8, "period": 3}),
    ("zipvl", {"tau": 0.5, "high_bits": 2, "group": 32}),
    ("zipvl_fixed", {"ratio": 0.3, "period": 4}),
    ("kivi", {"bits": 2, "residual": 8}),
    ("kivi", {"bits": 4, "residual": 0, "group": 32}),
    ("avl", {}),
    ("avl", {"secondary": 30, "core": 10, "update_every": 2, "prefill_keep": 60, "text_window": 40}),
    ("lookm", {}),
    ("lookm", {"recent_ratio": 0.05, "important_ratio": 0.2, "merge": "weighted"}),
    ("pyramidkv", {"budget": 0.2}),
    ("fastv", {"layer": 1, "drop": 75}),
    ("attentionpack", {"rank_k": 16, "rank_v": 16, "factor_dtype": "float32"}),
    ("attentionpack", {"rank_k": 16, "rank_v": 8, "groups": "0.25:1,0.75:0.25", "partial": "both", "period": 2}),
    ("attentionpack", {"rank_k": 12, "rank_v": 12, "low_group": "evict", "groups": "0.5:1,0.5:0.5", "period": 3}),
    ("attentionpack", {"rank_k": 16, "rank_v": 16, "quant_bits": 4, "quant_group": 8, "period": 0}),
    ("attentionpack", {"rank_k": 8, "rank_v": 8, "head_mode": "per_head", "groups": "0.5:1,0.5:0.5"}),
    ("attentionpack", {"rank_k": 16, "rank_v": 16, "rope": "after", "absorbed": True, "compress_text": True,
                       "text_rank": 4, "period": 2}),
    ("attentionpack", {"rank_scheme": "linear", "rank_min_k": 4, "rank_k": 16, "rank_min_v": 8, "rank_v": 16}),
    ("attentionpack", {"rank_scheme": "variance", "variance_target": 0.8, "rank_k": 24, "rank_v": 24}),
]


def generate() -> list[dict]:
    from kernels_py import ablation

    out = []
    for method, params in CASES:
        for workload in WORKLOADS:
            result = ablation.run(method, params, workload)
            out.append({"method": method, "params": params, "workload": workload, "metrics": result["metrics"],
                        "per_layer": result["per_layer"]})
    return out


def main(argv=None) -> int:
    if (sys.argv[1:] if argv is None else argv) != ["--write"]:
        print("usage: python -m kernels_py.tests.golden --write", file=sys.stderr)
        return 2
    PATH.write_text(json.dumps(generate(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
