"""The device type's name, as `import genie` renames PrivateUse1: one place for the string."""
DEVICE_TYPE = "remote_accelerator"
