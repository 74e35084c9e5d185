"""`ninfer bench`: reproducible speed runs on the GPU with a roofline and a peer in the same run."""
