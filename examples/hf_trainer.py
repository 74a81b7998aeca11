"""fusionguard inside the Hugging Face Trainer: one callback, counts in the Trainer's logs.

A random tiny Llama with attn_implementation="flex_attention" (no download).
- On a CUDA GPU: 3 training steps with TrainingArguments(torch_compile=True), strict mode:
  the first-step verdict says forward and backward fused.
- On CPU (FlexAttention has no backward there): evaluate(), first as transformers runs it (its
  own compiled flex_attention: fused), then forced dense (set_stance("force_eager"), warn mode):
  the verdict names the dense layers, and log_history carries fusionguard/dense_calls.

    pip install 'fusionguard[transformers]'
    python examples/hf_trainer.py          # writes ./fusionguard.jsonl
"""

import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import fusionguard
from fusionguard.integrations.transformers import FusionGuardCallback

KEYS = ("fusionguard/dense_calls", "fusionguard/fused_calls", "fusionguard/peak_layer_bytes")


def main() -> None:
    cuda = torch.cuda.is_available()
    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=256,
        attn_implementation="flex_attention",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (4, 128 if cuda else 32), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": x, "labels": x.clone()} for x in ids]
    args = TrainingArguments(
        output_dir="hf_trainer_out",
        max_steps=3,
        per_device_train_batch_size=1,
        per_device_eval_batch_size=1,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=not cuda,
        torch_compile=cuda,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows[:2])
    # attach(): first among the callbacks, so report_to's loggers (TensorBoard, W&B...) get the keys too
    FusionGuardCallback.attach(trainer, strict=cuda)

    if cuda:
        print("\n== 3 training steps, torch_compile=True, strict ==")
        trainer.train()
    else:
        print("\n== evaluate(): transformers' own compiled flex_attention ==")
        trainer.evaluate()
        print("\n== evaluate() forced dense (set_stance('force_eager')), warn mode ==")
        with torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
            warnings.simplefilter("ignore", fusionguard.DenseFallbackWarning)  # the verdict line says it once
            trainer.evaluate()
    for entry in trainer.state.log_history:
        print("log_history:", {k: v for k, v in entry.items() if k in KEYS or k in ("loss", "eval_loss", "step")})
    print("\nfusionguard report fusionguard.jsonl   # the per-layer table from the log")


if __name__ == "__main__":
    main()
