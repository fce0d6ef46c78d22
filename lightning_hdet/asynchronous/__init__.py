"""Asynchronous Local-SGD (Delayed Nesterov, dynamic local steps) and synchronous DiLoCo."""
