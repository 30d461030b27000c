"""Text in and out: `tokenizer.py` (tokenizer.json through `tokenizers`), `chat.py` (chat templates)."""
