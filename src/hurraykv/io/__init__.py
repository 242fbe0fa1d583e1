"""Floor 3: containers - the streaming format and the .hrry file."""
