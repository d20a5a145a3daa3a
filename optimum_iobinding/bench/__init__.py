"""The benchmark: the same ONNX files through every peer (ours, diffusers' numpy and torch pipelines, optimum's), on
one GPU in one run. One job per module: :mod:`.zoo` (the models and the export cache), :mod:`.probes` (what is
measured and how), :mod:`.peers` (what each peer loads, one peer measured in its process), :mod:`.report` (results
combined and rendered), :mod:`.cli` (the command line and the orchestration of the processes)."""
