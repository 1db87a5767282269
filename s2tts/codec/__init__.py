"""The DAC codec: the model, its loading and resampling (`dac`), and many streaming decodes batched over one
codec (`stream`)."""
