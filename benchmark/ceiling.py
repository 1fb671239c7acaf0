"""What eager PyTorch reaches on this machine with one model's own shapes, as a fraction of the matmul peak that
benchmark.py divides by. Two passes, each timed alone in one process, best of a few, right after the peak:

- training at its best: a forward and backward pass over one row of n tokens, the loss read from every position
  (no padding, no prompt split off, the LM head everywhere): 6 x N FLOPs per token, plus attention;
- sampling's inner loop: one decoding step of B rows after a prompt of 50 tokens, with a KV cache: 2 x N per row.

They bound a script's fraction of peak in benchmark.py's table (up to the peak's own variation from run to run):
they are the same model's passes with the waste taken out.

    python benchmark/ceiling.py                                   # SmolLM2-135M-Instruct, 1 thread (the CPU preset)
    python benchmark/ceiling.py --threads 2 --tokens 100 400 --rows 1 16
"""

import sys
import time
from functools import partial
from dataclasses import dataclass, field

import torch
import tyro

from benchmark import ROOT, forward_flops, matmul_parameters, matmul_peak
from transformers import DynamicCache

sys.path.insert(0, ROOT)
import grpo  # noqa: E402
from grpo import cache_kwarg, load_model  # noqa: E402


@dataclass
class Args:
    model: str = grpo.Args.model
    """Hub id, save_pretrained folder or .gguf file"""
    threads: int = 1
    """torch threads (the CPU preset runs each script on one)"""
    tokens: list[int] = field(default_factory=lambda: [25, 50, 100, 200, 400])
    """row lengths of the forward and backward pass"""
    rows: list[int] = field(default_factory=lambda: [1, 4, 16])
    """batch sizes of the decoding step"""
    repeats: int = 3
    """timings of each pass; the best counts"""


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(args: Args) -> None:
    torch.manual_seed(0)
    peak = matmul_peak(torch.float32, args.threads)
    n, layers, width = matmul_parameters(args.model)
    _, model = load_model(args.model)
    vocab = model.config.vocab_size
    lines = [f"Peak {peak / 1e9:.1f} GFLOP/s (a float32 matmul, {args.threads} thread(s)); N = {n / 1e6:.1f}M.", "",
             "| pass | shape | seconds | GFLOP/s | % of peak |", "|---|---|---|---|---|"]

    def row(name: str, shape: str, seconds: float, flops: float) -> None:
        rate = flops / seconds
        lines.append(f"| {name} | {shape} | {seconds:.3f} | {rate / 1e9:.1f} | {rate / peak:.0%} |")

    def train_pass(ids):
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)

    for t in args.tokens:
        ids = torch.randint(vocab, (1, t))
        seconds = best_seconds(partial(train_pass, ids), args.repeats)
        row("forward + backward", f"1 row x {t} tokens", seconds, 3 * t * forward_flops(n, layers, width, t / 2))

    @torch.no_grad()
    def decode_step(cache, token, position):  # then the cache is cut back to the prompt: every step sees 50 tokens
        model(input_ids=token, position_ids=position, use_cache=True, logits_to_keep=1, **cache_kwarg(model, cache))
        cache.crop(-1)  # (the token just added)

    for b in args.rows:
        cache, token, position = DynamicCache(), torch.randint(vocab, (b, 1)), torch.full((b, 1), 50)
        with torch.no_grad():
            model(input_ids=torch.randint(vocab, (b, 50)), use_cache=True, **cache_kwarg(model, cache))
        seconds = best_seconds(partial(decode_step, cache, token, position), 3 * args.repeats)
        shape = f"{b} row{'s' if b > 1 else ''}, 50 cached"
        row("decoding step", shape, seconds, b * forward_flops(n, layers, width, 50))
    print("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Args))
