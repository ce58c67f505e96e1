"""Model architectures (one plain file each), checkpoint reading and pooling detection."""
