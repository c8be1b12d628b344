"""Datasets, mock-ImageNet preparation, collate-level mixup and loaders (independent of the
rest of accel)."""
