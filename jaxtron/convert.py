"""Import a Hugging Face Llama or Mixtral directory as a jaxtron checkpoint to fine-tune from.

    python -m jaxtron.convert --from-hf path/to/Llama-3-8B --out checkpoints/llama3-8b
    python -m jaxtron.train --config configs/llama3-8b.yaml train.init_from=checkpoints/llama3-8b

The output is the same parameters-only format `python -m jaxtron.export --format orbax` writes:
`params/` (Orbax) and `config.yaml` with the model and moe sections read from config.json.
"""

from __future__ import annotations

import argparse
import sys

from jaxtron.checkpoint.params import check_output_dir, save_params
from jaxtron.config.loading import config_from_dict
from jaxtron.config.schema import Config
from jaxtron.errors import exits_on_user_error
from jaxtron.hf.files import load_hf_dir
from jaxtron.hf.translate import from_hf


def convert(hf_dir, out, overwrite: bool = False) -> Config:
    check_output_dir(out, overwrite)  # before anything is read
    hf_config, tensors = load_hf_dir(hf_dir)
    model, moe, params = from_hf(hf_config, tensors)
    config = config_from_dict({"model": model, "moe": moe})
    save_params(out, config, params, overwrite)
    return config


@exits_on_user_error
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtron.convert",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--from-hf", required=True, help="Hugging Face model directory")
    parser.add_argument("--out", required=True, help="output checkpoint directory")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier export or conversion in --out")
    args = parser.parse_args(argv)
    config = convert(args.from_hf, args.out, args.overwrite)
    m = config.model
    print(f"converted a {m.num_layers}-layer {m.type} model (d_model {m.d_model}, vocab "
          f"{m.vocab_size}) to {args.out}; fine-tune with train.init_from={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
