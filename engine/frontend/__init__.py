"""What the user's process runs: LLM, LLMEngine and AsyncLLMEngine, input and output processing,
the tokenizer, the incremental detokenizer (stop strings) and logprobs."""
