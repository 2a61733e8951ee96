"""Process groups and DTensor: the vocabulary split over ranks, arguments on a device mesh."""
