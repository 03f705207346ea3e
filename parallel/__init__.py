"""Process groups and the tensor- and pipeline-parallel building blocks the models are made of."""
