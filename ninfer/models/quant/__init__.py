"""Weight quantization transforms, applied to a built model (model files stay plain nn.Modules)."""
