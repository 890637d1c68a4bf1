"""Does benchmarks/interop/hf_realm_compat.py catch conversion mistakes? Break one detail of the
converter at a time, rerun the comparison on the models a previous `hf_realm_compat.py` run
saved in --work, and print which checks fail (each mutation must fail at least one).

  python benchmarks/interop/hf_realm_sensitivity.py --work /tmp/hf-realm-compat
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import hf_realm_compat  # noqa: E402

import ralm.convert.hf_realm as converter  # noqa: E402

ORIGINAL = {name: getattr(converter, name) for name in ("bert_config", "build_retriever", "build_reader", "reader_state")}


def gelu(config):
    return {**ORIGINAL["bert_config"](config), "hidden_act": "gelu"}


def cls_pooling(*args, **kwargs):
    model = ORIGINAL["build_retriever"](*args, **kwargs)
    model.cfg.pooling = "cls"
    return model


def one_segment_blocks(*args, **kwargs):
    model = ORIGINAL["build_retriever"](*args, **kwargs)
    model.cfg.pair_sep_id = None  # blocks with segment id 0 on the body too
    return model


def no_span_layernorm(*args, **kwargs):
    model = ORIGINAL["build_reader"](*args, **kwargs)
    model.spans.norm = torch.nn.Identity()
    model.cfg.span_layernorm_eps = None
    return model


def start_bias_only(state, src):
    out = ORIGINAL["reader_state"](state, src)
    b = state[f"{src}qa_outputs.dense_intermediate.bias"]
    out["spans.start.bias"] = b[: b.shape[0] // 2]
    return out


MUTATIONS = [("gelu for gelu_new", "bert_config", gelu), ("[CLS] instead of pooler", "build_retriever", cls_pooling),
             ("segment 0 on the block body", "build_retriever", one_segment_blocks),
             ("no span LayerNorm", "build_reader", no_span_layernorm), ("start bias only", "reader_state", start_bias_only)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/hf-realm-compat"))
    args = ap.parse_args()
    caught = True
    for name, attr, broken in MUTATIONS:
        for k, v in ORIGINAL.items():
            setattr(converter, k, v)
        setattr(converter, attr, broken)
        r = hf_realm_compat.stage_ralm(args.work)
        failed = [c for c, ok in r["checks"].items() if not ok]
        caught &= bool(failed)
        print(f"{name}: relevance {r['relevance_max_abs_diff']:.2e}, mlm {r['mlm_loss']['abs_diff']:.2e}, "
              f"reader logits {r['reader']['span_logits_max_abs_diff']:.2e}; failed: {failed}", flush=True)
    sys.exit(0 if caught else 1)


if __name__ == "__main__":
    main()
