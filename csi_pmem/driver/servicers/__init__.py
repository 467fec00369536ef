"""gRPC servicers: one module per CSI service. They validate, lock, delegate, translate."""
