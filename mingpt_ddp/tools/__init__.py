"""Commands off the training path (bench, sample, export, plot, sweep summaries, preflight, prepare, torchrun, network): they import the training path, never the reverse."""
