"""The HTTP transport: everything that touches hypercorn's or h11's internals."""
