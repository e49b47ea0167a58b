"""Export a training checkpoint: consolidated parameters (Orbax) or a Hugging Face directory.

    python -m jaxtron.export --checkpoint runs/tiny --out exports/tiny --format orbax
    python -m jaxtron.export --checkpoint runs/llama --out exports/llama-hf --format hf

`--checkpoint` is any jaxtron checkpoint: a run directory (its newest good checkpoint, or
`--step N`) or a parameters-only checkpoint from `export` or `convert` (to turn it into a
Hugging Face directory, say). The orbax format is a parameters-only checkpoint in the model's layout plus the resolved `config.yaml`: it restores on
one device with no mesh (`orbax.checkpoint.StandardCheckpointer().restore(OUT / "params")`), is
what `train.init_from` and `jaxtron.generate` read, and is what `jaxtron.convert` writes.
"""

from __future__ import annotations

import argparse
import sys

from jaxtron.checkpoint.params import check_output_dir, output_dir, read_params, save_params
from jaxtron.errors import exits_on_user_error
from jaxtron.hf.files import save_hf_dir
from jaxtron.hf.translate import to_hf


@exits_on_user_error
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtron.export",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True,
                        help="a training run directory, or an export/convert output")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--format", choices=("orbax", "hf"), default="orbax")
    parser.add_argument("--step", type=int, help="checkpoint step (default: newest)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier export in --out (never a run's folder)")
    args = parser.parse_args(argv)
    check_output_dir(args.out, args.overwrite)  # before anything is read
    config, params = read_params(args.checkpoint, args.step)
    if args.format == "orbax":
        out = save_params(args.out, config, params, args.overwrite)
    else:
        hf_config, tensors = to_hf(config, params)
        out = output_dir(args.out, args.overwrite)
        save_hf_dir(out, hf_config, tensors)
    print(f"exported {args.format} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
