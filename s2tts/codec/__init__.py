"""The DAC codec: the model (`model`), its loading (`loading`), audio into it (`audio`: resampling), its Triton
kernels (`kernels`), and many streaming decodes batched over one codec (`stream`)."""
