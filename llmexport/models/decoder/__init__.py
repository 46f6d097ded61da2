"""The Llama layout every plain decoder shares: names, config, graph pieces and the family base."""
