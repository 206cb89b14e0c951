"""Host side: what applications import."""
