"""MNN's tokenizer file: the writer, the runtime's pipeline and regex engines, and the model of how
the runtime streams decoded text."""
