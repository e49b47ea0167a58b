"""Sample text from a trained or imported model.

    python -m jaxtron.generate --checkpoint runs/tiny --prompt "def main(" --max-new-tokens 64

`--checkpoint` is a training run directory (its newest good checkpoint, or `--step N`) or an
export/convert output; only the model's parameters are read. Generation itself is
`jaxtron.models.generation.generate`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxtron.checkpoint.params import read_model
from jaxtron.data.corpus import BUILTIN_STDLIB
from jaxtron.data.tokenizer import ByteTokenizer, load_tokenizer
from jaxtron.errors import ConfigError, exits_on_user_error
from jaxtron.models.generation import generate


def _tokenizer(config):
    if config.data.path == BUILTIN_STDLIB:
        return ByteTokenizer()
    meta = Path(f"{config.data.path}.json")
    if meta.is_file():
        return load_tokenizer(json.loads(meta.read_text())["tokenizer"])
    return None


@exits_on_user_error
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtron.generate",
                                     description="Sample text from a trained or imported model.")
    parser.add_argument("--checkpoint", required=True,
                        help="training run directory or exported/converted checkpoint")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (encoded with the run's tokenizer)")
    source.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step of a run")
    args = parser.parse_args(argv)
    config, model = read_model(args.checkpoint, args.step)
    tokenizer = _tokenizer(config)
    if args.prompt is not None:
        if tokenizer is None:
            raise ConfigError(f"no tokenizer is known for data.path={config.data.path}; "
                              "pass --prompt-ids instead of --prompt.")
        prompt = tokenizer.encode(args.prompt)
    else:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ConfigError(f"--prompt-ids {args.prompt_ids!r} must be comma-separated "
                              "integers, e.g. 1,2,3.") from None
    ids = generate(model, prompt, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    print("ids:", ",".join(map(str, ids)))
    if tokenizer is not None:
        print("text:", (args.prompt or "") + tokenizer.decode(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
