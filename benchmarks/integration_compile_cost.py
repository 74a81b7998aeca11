"""What the Hugging Face callback adds to the compile of ``TrainingArguments(torch_compile=True)``
(issue 28: within 5 % of the warm compile without it).

Each trial builds a fresh Trainer around a fresh random Llama (2 layers, flex_attention), resets
Dynamo, and times ``trainer.train()`` for one optimizer step: Dynamo's trace, AOTAutograd and
Inductor (warm: Inductor's caches hold the kernels after the first trial, so this is the compile
work a re-run pays) plus one step. On CPU (no FlexAttention backward) ``evaluate()`` of 4 rows instead. Variants, rotated each round:

- ``none``: no fusionguard;
- ``callback``: ``FusionGuardCallback`` (enable + names-only watch: no hooks Dynamo traces);
- ``hooks``: ``fusionguard.enable()`` and ``watch(model)`` entered before the Trainer compiles the
  model (what a user reaching into the Trainer gets: hooks Dynamo traced before #24, out of its
  sight while it compiles since).

    python benchmarks/integration_compile_cost.py [--rounds 5] [--device cuda]

Prints medians, ranges and each variant's ratio to ``none`` (target for ``callback``: <= 1.05).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

import fusionguard
from fusionguard import _testing


def trial(variant: str, device: str, out: str) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    from transformers.integrations import flex_attention as hf_flex

    torch._dynamo.reset()
    hf_flex.WrappedFlexAttention._instance = None
    cfg = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=512,
        vocab_size=256,
        attn_implementation="flex_attention",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    seq = 512 if device == "cuda" else 64
    rows = [{"input_ids": i, "labels": i.clone()} for i in torch.randint(0, 256, (4, seq), generator=g)]
    args = TrainingArguments(
        output_dir=out,
        max_steps=1,
        per_device_train_batch_size=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        torch_compile=True,
        use_cpu=device == "cpu",
        bf16=device == "cuda",
    )
    callbacks = []
    watch = None
    if variant == "callback":
        from fusionguard.integrations.transformers import FusionGuardCallback

        callbacks.append(FusionGuardCallback(log_path=False))
    elif variant == "hooks":
        fusionguard.enable(log_path=False)
        watch = fusionguard.watch(model).__enter__()
    trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows, callbacks=callbacks)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if device == "cuda":
        trainer.train()
    else:  # FlexAttention has no backward on CPU: the inference compile of evaluate()
        trainer.evaluate()
    if device == "cuda":
        torch.cuda.synchronize()
    took = time.perf_counter() - t0
    if watch is not None:
        watch.__exit__(None, None, None)
    fusionguard.disable()
    _testing.reset_for_tests()
    return took


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    warnings.simplefilter("ignore")
    variants = ["none", "callback", "hooks"]
    times: dict = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as out:
        trial("none", a.device, out)  # fills Inductor's caches: every timed trial is warm
        for r in range(a.rounds):
            for v in variants[r % 3 :] + variants[: r % 3]:
                times[v].append(trial(v, a.device, out))
                print(f"round {r} {v}: {times[v][-1]:.2f} s", file=sys.stderr)
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, device {a.device}"
        f"{' ' + torch.cuda.get_device_name() if a.device == 'cuda' else ''}, {a.rounds} rounds, "
        f"TORCHINDUCTOR_CACHE_DIR={os.environ.get('TORCHINDUCTOR_CACHE_DIR', '(default)')}"
    )
    base = statistics.median(times["none"])
    print(f"{'variant':<10} {'median s':>9} {'min':>7} {'max':>7} {'/ none':>7}")
    for v in variants:
        m = statistics.median(times[v])
        print(f"{v:<10} {m:9.2f} {min(times[v]):7.2f} {max(times[v]):7.2f} {m / base:7.3f}")


if __name__ == "__main__":
    main()
