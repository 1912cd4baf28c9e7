"""Commands off the training path (bench, sample, export, plot, sweep summaries, pre-flight, prepare, the torchrun wrapper); `python -m mingpt_ddp.<name>` runs each."""
