"""The benchmark: the same ONNX files through every peer (ours, diffusers' numpy and torch pipelines, optimum's), on
one GPU in one run."""
