"""Media decoding: images (fetch, decode, resize), videos (probe, plan, PyAV decode),
videos given as frames, and the video sampling and placeholder rules."""
