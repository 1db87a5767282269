"""What both the AR and the codec need of the GPU: streams and graph capture, host transfers that do not wait,
modules built without storage, device names, GPU timing."""
