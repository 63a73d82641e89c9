"""Hugging Face models in raylane (`pip install 'raylane[hf]'`): LoRA through peft
(raylane.hf.lora) and an export that `from_pretrained` reads (raylane.hf.export). `import
raylane` never imports this package; its modules import transformers and peft inside their
functions, so that a config can be checked without them."""
