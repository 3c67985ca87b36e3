"""SGLang interop: glmkit's rollout engine behind SGLang's native HTTP API (`server`), and the client
that talks to any server speaking it, SGLang's own included (`client`). Schemas in `protocol`."""
