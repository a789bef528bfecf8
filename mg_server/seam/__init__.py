"""mg inside SGLang's scheduler process: the step seam on the sampler, its link to the controller,
the window commit and the gate kernels it launches (loaded by the hook factory string)."""
