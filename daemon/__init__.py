"""spotvisord: the control plane that keeps a spot pool and its training job alive."""
