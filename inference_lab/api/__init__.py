"""The OpenAI wire format, pure (no trio): request parsing, the placeholder text, response
bodies and stream frames, and the prompt tokenizers."""
