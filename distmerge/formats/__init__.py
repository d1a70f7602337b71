"""Input layouts. Each module answers: is this my layout, which files, which fragments, read one."""
