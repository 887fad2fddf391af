"""The MQTT doors of a worker: TCP, TLS and WebSocket listeners over the sans-I/O session (docs/mqtt.md)."""
