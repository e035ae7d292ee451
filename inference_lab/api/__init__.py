"""The OpenAI wire format, pure (no trio), by concern:

- :mod:`~inference_lab.api.schema`: the body schemas and their strict converter;
- :mod:`~inference_lab.api.requests`: completion requests parsed, counted and decided;
- :mod:`~inference_lab.api.text`: the placeholder text, stop points and logprobs;
- :mod:`~inference_lab.api.encoding`: ids, usage, bodies and the stream's frames;
- :mod:`~inference_lab.api.tokenize`: ``/tokenize`` and ``/detokenize``;
- :mod:`~inference_lab.api.tokenizer`: the prompt tokenizers.
"""
