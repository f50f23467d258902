"""Moving weights between Megatron and Hugging Face: names, gathers, buckets, files, streams."""
