"""Write a Qwen2.5-VL checkpoint folder with Qwen2.5-VL-3B-Instruct's widths and seeded random weights, for
`ficoco serve-bench` where no real checkpoint is at hand (no network: nothing is downloaded).

Qwen2.5-VL-3B-Instruct's published config: the 7B's vision tower (32 blocks, 1280 wide, full attention in blocks
7, 15, 23, 31), a 2048-wide Qwen2.5 decoder of 36 layers (11008-wide MLP, 16 query and 2 KV heads), a
151,936-token vocabulary, tied embeddings. `--tower-blocks` and `--decoder-layers` cut the two stacks (every block
and layer keeps its widths); cutting both to the same share keeps the model's split of cost between the tower and
the LLM, which decides what a method acting after the tower can save. The tower keeps one full-attention block in
every eight, as the checkpoint does. The tokenizer is a byte-level one with Qwen's special tokens (the tests'
helper), the image processor Qwen2-VL's PIL one at the family's pixel bounds, the chat template ChatML's.

    python benchmarks/serving_checkpoint.py ./qwen2.5-vl-3b-widths --tower-blocks 4 --decoder-layers 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Qwen2.5-VL-3B-Instruct's config.json where it differs from the 7B profile's.
QWEN2_5_VL_3B = {"text_config.hidden_size": 2048, "text_config.intermediate_size": 11008,
                 "text_config.num_hidden_layers": 36, "text_config.num_attention_heads": 16,
                 "text_config.num_key_value_heads": 2, "text_config.vocab_size": 151936,
                 "text_config.max_window_layers": 70, "text_config.tie_word_embeddings": True,
                 "tie_word_embeddings": True, "vision_config.out_hidden_size": 2048}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="the checkpoint folder to write (created)")
    parser.add_argument("--tower-blocks", type=int, default=32, help="vision tower blocks (32: the whole tower)")
    parser.add_argument("--decoder-layers", type=int, default=36, help="decoder layers (36: the whole decoder)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not 1 <= args.tower_blocks <= 32 or not 1 <= args.decoder_layers <= 36:
        print("serving_checkpoint: --tower-blocks is 1..32 and --decoder-layers 1..36", file=sys.stderr)
        return 2

    import ficoco
    from tests.helpers import FAMILIES, make_processor

    specials = FAMILIES["qwen2_5_vl"][1]  # the helper tokenizer's ids for Qwen's special tokens
    ids = {name: index for index, name in specials.items()}
    full = [b for b in range(args.tower_blocks) if b % 8 == 7] or [args.tower_blocks - 1]
    overrides = {**QWEN2_5_VL_3B, "text_config.num_hidden_layers": args.decoder_layers,
                 "vision_config.depth": args.tower_blocks, "vision_config.fullatt_block_indexes": full,
                 "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
                 "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
                 "text_config.bos_token_id": 1, "text_config.eos_token_id": 2}
    model = ficoco.build_model("qwen2.5-vl-7b", dtype="fp32", check_memory=False, overrides=overrides,
                               seed=args.seed)
    folder = Path(args.folder)
    model.save_pretrained(folder)
    tokenizer, images, template = make_processor("qwen2_5_vl", model)
    tokenizer.save_pretrained(folder)
    images.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(template)
    (folder / "ficoco_checkpoint.json").write_text(json.dumps(
        {"widths_of": "Qwen/Qwen2.5-VL-3B-Instruct", "weights": f"random, seed {args.seed}",
         "tower_blocks": f"{args.tower_blocks} of 32", "decoder_layers": f"{args.decoder_layers} of 36",
         "fullatt_block_indexes": full}, indent=1) + "\n")
    print(f"wrote {folder}: Qwen2.5-VL-3B widths, {args.tower_blocks} of 32 tower blocks, {args.decoder_layers} of "
          f"36 decoder layers, random weights (seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
