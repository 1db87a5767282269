"""What s2pro does for a request around the engine: its fields checked (`request`), its text cut into segments
(`segment`), its prompts (`prompt`), its life from arrival to final response across the models (`orchestrator`),
and the engine held in s2pro's own process (`local_engine`)."""
