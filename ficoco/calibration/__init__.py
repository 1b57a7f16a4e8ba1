"""Offline calibrations of the methods whose official code picks a setting from the model's own outputs before it
runs (`ficoco calibrate METHOD`): each is a library function that builds the model, runs the official search on the
user's inputs (a checkpoint's processor laying out local images and prompts) or on synthetic inputs of random
weights (said so in its result), and returns a record the CLI renders and writes as JSON. No hidden download: the
inputs are the user's.

- `vtw`: VTW's layer K, the first decoder layer whose withdrawal moves the last token's distribution by at most eta
  (mean KL over the samples), as lzhxmu/VTW's `--findk` does.
"""
