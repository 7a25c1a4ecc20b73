//! The CNN of PyTorch's CIFAR-10 tutorial, and the same with BatchNorm.

use crate::nn::{self, max_pool2d, Conv2d};
use candle_core::{Module, Result, Tensor};
use candle_nn::{Conv2dConfig, Init, Linear, ModuleT, VarBuilder};

/// The CIFAR-10 tutorial's CNN: conv 3→6 (5×5), max-pool 2, conv 6→16 (5×5), max-pool 2,
/// fc 400→120, fc 120→84, fc 84→10, with ReLU after each layer but the last.
///
/// Each convolution runs with its ReLU and max-pooling as one op
/// ([`nn::Conv2d::forward_relu_max_pool2d`]) and each linear layer with its ReLU
/// ([`nn::linear_relu`]): our CPU training kernels for f32 on the CPU, candle's ops elsewhere.
///
/// Variables are named `conv1`, `conv2`, `fc1`, `fc2`, `fc3` (each with `weight` and `bias`) and
/// initialised as PyTorch initialises `Conv2d` and `Linear`: uniform in `±1/sqrt(fan_in)`. A
/// checkpoint of a `DataParallel<Net>` is a checkpoint of a plain `Net`: no `module.` prefix.
#[derive(Clone, Debug)]
pub struct Net {
    conv1: Conv2d,
    conv2: Conv2d,
    fc1: Linear,
    fc2: Linear,
    fc3: Linear,
}

/// PyTorch's default initialisation: `kaiming_uniform(a = sqrt(5))` for the weight, which is
/// uniform in `±1/sqrt(fan_in)`, and the same bound for the bias.
fn torch_default(vb: &VarBuilder, weight_shape: &[usize]) -> Result<(Tensor, Tensor)> {
    let fan_in: usize = weight_shape[1..].iter().product();
    let bound = 1.0 / (fan_in as f64).sqrt();
    let init = Init::Uniform {
        lo: -bound,
        up: bound,
    };
    let weight = vb.get_with_hints(weight_shape, "weight", init)?;
    let bias = vb.get_with_hints(weight_shape[0], "bias", init)?;
    Ok((weight, bias))
}

fn conv(vb: VarBuilder, cin: usize, cout: usize, k: usize) -> Result<Conv2d> {
    let (w, b) = torch_default(&vb, &[cout, cin, k, k])?;
    Ok(Conv2d::new(w, Some(b), Conv2dConfig::default()))
}

fn fc(vb: VarBuilder, fin: usize, fout: usize) -> Result<Linear> {
    let (w, b) = torch_default(&vb, &[fout, fin])?;
    Ok(Linear::new(w, Some(b)))
}

impl Net {
    /// Builds the network from `vb` (creating its variables when `vb` is backed by a `VarMap`).
    pub fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            conv1: conv(vb.pp("conv1"), 3, 6, 5)?,
            conv2: conv(vb.pp("conv2"), 6, 16, 5)?,
            fc1: fc(vb.pp("fc1"), 16 * 5 * 5, 120)?,
            fc2: fc(vb.pp("fc2"), 120, 84)?,
            fc3: fc(vb.pp("fc3"), 84, 10)?,
        })
    }
}

impl Module for Net {
    /// Images `(B, 3, 32, 32)` to logits `(B, 10)`.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let x = self.conv1.forward_relu_max_pool2d(xs, 2)?;
        let x = self.conv2.forward_relu_max_pool2d(&x, 2)?.flatten_from(1)?;
        let x = nn::linear_relu(&x, &self.fc1)?;
        nn::linear(&nn::linear_relu(&x, &self.fc2)?, &self.fc3)
    }
}

/// The tutorial's [`Net`] with a BatchNorm after each convolution (before its ReLU): conv 3→6,
/// bn, max-pool, conv 6→16, bn, max-pool, fc 400→120→84→10.
///
/// The BatchNorm layers come from [`nn::batch_norm`]: candle-nn's BatchNorm in one process,
/// SyncBatchNorm when DistributedDataParallel builds the model with `sync_batch_norm` set.
/// Variables: those of `Net`, plus `bn1` and `bn2` (`weight`, `bias`, `running_mean`,
/// `running_var`).
#[derive(Clone, Debug)]
pub struct NetBn {
    conv1: Conv2d,
    bn1: nn::BatchNorm,
    conv2: Conv2d,
    bn2: nn::BatchNorm,
    fc1: Linear,
    fc2: Linear,
    fc3: Linear,
}

impl NetBn {
    /// Builds the network from `vb`.
    pub fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            conv1: conv(vb.pp("conv1"), 3, 6, 5)?,
            bn1: nn::batch_norm(6, 1e-5, vb.pp("bn1"))?,
            conv2: conv(vb.pp("conv2"), 6, 16, 5)?,
            bn2: nn::batch_norm(16, 1e-5, vb.pp("bn2"))?,
            fc1: fc(vb.pp("fc1"), 16 * 5 * 5, 120)?,
            fc2: fc(vb.pp("fc2"), 120, 84)?,
            fc3: fc(vb.pp("fc3"), 84, 10)?,
        })
    }

    /// Whether the BatchNorm layers are synchronised over ranks.
    pub fn is_synchronised(&self) -> bool {
        matches!(self.bn1, nn::BatchNorm::Sync(_))
    }
}

impl ModuleT for NetBn {
    /// Images `(B, 3, 32, 32)` to logits `(B, 10)`; `train` selects batch or running statistics.
    fn forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        let x = self.bn1.forward_t(&xs.apply(&self.conv1)?, train)?;
        let x = max_pool2d(&x.relu()?, 2)?.apply(&self.conv2)?;
        max_pool2d(&self.bn2.forward_t(&x, train)?.relu()?, 2)?
            .flatten_from(1)?
            .apply(&self.fc1)?
            .relu()?
            .apply(&self.fc2)?
            .relu()?
            .apply(&self.fc3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use candle_nn::VarMap;

    #[test]
    fn has_the_tutorial_shapes_and_names() -> Result<()> {
        let varmap = VarMap::new();
        let net = Net::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
        let mut shapes: Vec<(String, Vec<usize>)> = varmap
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.dims().to_vec()))
            .collect();
        shapes.sort();
        let want: Vec<(String, Vec<usize>)> = [
            ("conv1.bias", vec![6]),
            ("conv1.weight", vec![6, 3, 5, 5]),
            ("conv2.bias", vec![16]),
            ("conv2.weight", vec![16, 6, 5, 5]),
            ("fc1.bias", vec![120]),
            ("fc1.weight", vec![120, 400]),
            ("fc2.bias", vec![84]),
            ("fc2.weight", vec![84, 120]),
            ("fc3.bias", vec![10]),
            ("fc3.weight", vec![10, 84]),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        assert_eq!(shapes, want);
        let params: usize = shapes
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        assert_eq!(params, 62_006); // the tutorial's parameter count
        let x = Tensor::zeros((2, 3, 32, 32), DType::F32, &Device::Cpu)?;
        assert_eq!(net.forward(&x)?.dims(), [2, 10]);
        let bound = 1.0 / 75f32.sqrt();
        let w = varmap.data().lock().unwrap()["conv1.weight"]
            .flatten_all()?
            .to_vec1::<f32>()?;
        assert!(w.iter().all(|v| v.abs() <= bound));
        Ok(())
    }
}
